#!/usr/bin/env bash
# Run a statically linked x86-64 Linux executable inside Bochs on an AVX-512
# capable CPU model (default corei7_skylake_x) and return its output + exit code.
#
# Usage: tools/avx512-bochs/run.sh PATH_TO_STATIC_EXE [ARGS...]
#
# Exit status: the guest program's exit status (128+N if killed by signal N),
#              124 on timeout, 125 on harness failure.
# See README.md next to this file for the environment variables.
set -euo pipefail

die() { echo "avx512-bochs: error: $*" >&2; exit 125; }
log() { echo "avx512-bochs: $*" >&2; }

[[ $# -ge 1 ]] || { echo "usage: $0 PATH_TO_STATIC_EXE [ARGS...]" >&2; exit 125; }
EXE=$1; shift
[[ -f $EXE && -x $EXE ]] || die "not an executable file: $EXE"
EXE=$(readlink -f -- "$EXE")

WORK=${AVX512_BOCHS_WORKDIR:-${XDG_CACHE_HOME:-$HOME/.cache}/k3ring/avx512-bochs}
CPU_MODEL=${BOCHS_CPU:-corei7_skylake_x}
TIMEOUT=${AVX512_BOCHS_TIMEOUT:-1200}        # seconds (wall clock, whole run incl. boot)
MEM_MB=${AVX512_BOCHS_MEM:-1024}
IPS=${AVX512_BOCHS_IPS:-100000000}           # emulated instructions per emulated second
KERNEL_PKG=${AVX512_BOCHS_KERNEL_PKG:-linux-image-cloud-amd64}
EXTRA_CMDLINE=${AVX512_BOCHS_CMDLINE:-}
VERBOSE=${AVX512_BOCHS_VERBOSE:-0}           # 1: also print the guest boot log to stderr
KEEP=${AVX512_BOCHS_KEEP:-0}                 # 1: keep the per-run directory
PASSENV="RUST_BACKTRACE RUST_LIB_BACKTRACE RUST_LOG RUST_TEST_THREADS RUST_MIN_STACK ${AVX512_BOCHS_PASSENV:-}"

START_MARK=AVX512-BOCHS-START
EXIT_MARK=AVX512-BOCHS-EXIT

if command -v file >/dev/null 2>&1; then
    if [[ $(file -L -- "$EXE") == *'dynamically linked'* ]]; then
        die "$EXE is dynamically linked; build it with RUSTFLAGS='-C target-feature=+crt-static' (the guest has no libc)"
    fi
fi

mkdir -p "$WORK"

# --------------------------------------------------------------------------
# One-time setup (cached): host tools + guest kernel.
# --------------------------------------------------------------------------
need_pkgs=()
command -v bochs    >/dev/null 2>&1 || need_pkgs+=(bochs)
ls /usr/lib/x86_64-linux-gnu/bochs/plugins/libbx_term_gui.so* >/dev/null 2>&1 || need_pkgs+=(bochs-term)
[[ -f /usr/share/bochs/BIOS-bochs-latest ]] || need_pkgs+=(bochsbios)
[[ -f /usr/share/vgabios/vgabios.bin ]]     || need_pkgs+=(vgabios)
[[ -f /usr/lib/ISOLINUX/isolinux.bin ]]     || need_pkgs+=(isolinux)
[[ -f /usr/lib/syslinux/modules/bios/ldlinux.c32 ]] || need_pkgs+=(syslinux-common)
command -v xorriso  >/dev/null 2>&1 || need_pkgs+=(xorriso)
command -v cpio     >/dev/null 2>&1 || need_pkgs+=(cpio)
[[ -x /bin/busybox ]] || need_pkgs+=(busybox-static)
if [[ ${#need_pkgs[@]} -gt 0 ]]; then
    [[ $(id -u) -eq 0 ]] || die "missing packages: ${need_pkgs[*]} (apt-get install them)"
    log "installing ${need_pkgs[*]}"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}") >&2 \
        || die "apt-get install ${need_pkgs[*]} failed"
fi
# The list is taken whole before it is searched: busybox writes it a name per write(), so a
# `grep -q` that stops at the match leaves it a SIGPIPE, which pipefail reports as a failure
# (about 1 run in 100, which skipped the emulated twins).
applets=$(/bin/busybox --list 2>/dev/null || true)
grep -qx poweroff <<<"$applets" || die "/bin/busybox is not busybox-static (apt-get install busybox-static)"

KDIR=$WORK/kernel
(
    flock 9
    if [[ ! -s $KDIR/vmlinuz ]]; then
        log "fetching guest kernel ($KERNEL_PKG)"
        tmp=$(mktemp -d "$WORK/kfetch.XXXXXX")
        trap 'rm -rf "$tmp"' EXIT
        pkg=$KERNEL_PKG
        # Resolve a meta package (linux-image-cloud-amd64) to the versioned image package.
        dep=$(apt-cache depends "$pkg" 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -n1 || true)
        if [[ -z $dep && $(id -u) -eq 0 ]]; then
            apt-get update -qq >&2 || true
            dep=$(apt-cache depends "$pkg" 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -n1 || true)
        fi
        [[ -n $dep ]] && pkg=$dep
        (cd "$tmp" && apt-get download "$pkg" >&2 2>/dev/null) || (cd "$tmp" && apt-get download "$pkg" >&2) \
            || { echo "avx512-bochs: apt-get download $pkg failed" >&2; exit 1; }
        dpkg-deb -x "$tmp"/*.deb "$tmp/x"
        vmlinuz=$(ls "$tmp"/x/boot/vmlinuz-* | head -n1)
        mkdir -p "$KDIR"
        cp "$tmp"/x/boot/config-* "$KDIR/config"
        basename "$vmlinuz" | sed 's/^vmlinuz-//' > "$KDIR/version"
        cp "$vmlinuz" "$KDIR/vmlinuz.tmp" && mv "$KDIR/vmlinuz.tmp" "$KDIR/vmlinuz"
        log "guest kernel $(cat "$KDIR/version") cached in $KDIR"
    fi
) 9>"$WORK/.lock" || die "kernel setup failed"

# --------------------------------------------------------------------------
# Per-run: initramfs (busybox + wrapper /init + program), ISO, bochsrc.
# --------------------------------------------------------------------------
mkdir -p "$WORK/runs"
RUN=$(mktemp -d "$WORK/runs/run.XXXXXX")
BOCHS_PID=
cleanup() {
    if [[ -n $BOCHS_PID ]] && kill -0 "$BOCHS_PID" 2>/dev/null; then
        kill "$BOCHS_PID" 2>/dev/null || true
        sleep 0.2; kill -9 "$BOCHS_PID" 2>/dev/null || true
    fi
    if [[ $KEEP == 1 ]]; then log "run dir kept: $RUN"; else rm -rf "$RUN"; fi
}
trap cleanup EXIT
trap 'exit 125' INT TERM

ROOT=$RUN/root
mkdir -p "$ROOT"/{bin,sbin,dev,proc,sys,tmp,run,etc,prog}
cp /bin/busybox "$ROOT/bin/busybox"
for a in $(/bin/busybox --list); do
    [[ $a == busybox ]] || ln -sf busybox "$ROOT/bin/$a"
done
PROG_NAME=$(basename -- "$EXE")
cp -- "$EXE" "$ROOT/prog/$PROG_NAME"
chmod 0755 "$ROOT/prog/$PROG_NAME"
printf 'root:x:0:0:root:/:/bin/sh\n' > "$ROOT/etc/passwd"

# Program arguments / environment, single-quoted for busybox sh.
q() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }
{
    printf 'set --'
    for a in "$@"; do printf ' %s' "$(q "$a")"; done
    printf '\n'
    for v in $PASSENV; do
        if [[ -n ${!v+x} ]]; then printf 'export %s=%s\n' "$v" "$(q "${!v}")"; fi
    done
} > "$ROOT/args.sh"

cat > "$ROOT/init" <<EOF
#!/bin/busybox sh
export PATH=/bin:/sbin:/prog HOME=/ TERM=dumb
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t tmpfs tmpfs /tmp
# Keep kernel messages out of the program's output from now on.
echo 1 > /proc/sys/kernel/printk
stty -F /dev/console -opost 2>/dev/null
. /args.sh
echo "$START_MARK \$(cat /proc/uptime)"
cd /
"/prog/$PROG_NAME" "\$@"
rc=\$?
echo "$EXIT_MARK \$rc"
sleep 1
poweroff -f
EOF
chmod 0755 "$ROOT/init"
mkdir -p "$RUN/iso/isolinux"
(cd "$ROOT" && find . -print0 | cpio --null -o -H newc --owner=0:0 --quiet) > "$RUN/iso/initrd.img" \
    || die "cpio failed"
rm -rf "$ROOT"

cp /usr/lib/ISOLINUX/isolinux.bin /usr/lib/syslinux/modules/bios/ldlinux.c32 "$RUN/iso/isolinux/"
ln "$KDIR/vmlinuz" "$RUN/iso/vmlinuz" 2>/dev/null || cp "$KDIR/vmlinuz" "$RUN/iso/vmlinuz"
CMDLINE="console=ttyS0,115200 quiet loglevel=3 panic=-1 oops=panic mitigations=off nokaslr tsc=reliable no_timer_check random.trust_cpu=on 8250.nr_uarts=1 noxsaves clearcpuid=xsavec,pku cryptomgr.notests rdinit=/init $EXTRA_CMDLINE"
cat > "$RUN/iso/isolinux/isolinux.cfg" <<EOF
DEFAULT linux
PROMPT 0
TIMEOUT 0
LABEL linux
  KERNEL /vmlinuz
  INITRD /initrd.img
  APPEND $CMDLINE
EOF
xorriso -as mkisofs -quiet -o "$RUN/boot.iso" -R -J \
    -b isolinux/isolinux.bin -c isolinux/boot.cat -no-emul-boot -boot-load-size 4 -boot-info-table \
    "$RUN/iso" >"$RUN/xorriso.log" 2>&1 || { cat "$RUN/xorriso.log" >&2; die "xorriso failed"; }
rm -rf "$RUN/iso"

SERIAL=$RUN/serial.log
: > "$SERIAL"
cat > "$RUN/bochsrc" <<EOF
config_interface: textconfig
display_library: term
memory: guest=$MEM_MB, host=$MEM_MB
romimage: file=/usr/share/bochs/BIOS-bochs-latest
vgaromimage: file=/usr/share/vgabios/vgabios.bin
cpu: model=$CPU_MODEL, count=1, ips=$IPS, reset_on_triple_fault=0, ignore_bad_msrs=1
clock: sync=none, time0=local
ata0: enabled=1, ioaddr1=0x1f0, ioaddr2=0x3f0, irq=14
ata0-master: type=cdrom, path="$RUN/boot.iso", status=inserted
ata1: enabled=0
boot: cdrom
floppy_bootsig_check: disabled=1
com1: enabled=1, mode=file, dev="$SERIAL"
mouse: enabled=0
speaker: enabled=0
private_colormap: enabled=0
log: $RUN/bochs.log
logprefix: %t%e%d
panic: action=fatal
error: action=report
info: action=ignore
debug: action=ignore
EOF

# --------------------------------------------------------------------------
# Boot, stream the program's output, wait for the exit marker.
# --------------------------------------------------------------------------
log "booting $(cat "$KDIR/version") on bochs cpu=$CPU_MODEL mem=${MEM_MB}M (timeout ${TIMEOUT}s)"
T0=$(date +%s.%N)
printf 'c\nquit\n' > "$RUN/debugger.rc"   # Debian's bochs has the debugger built in: just continue.
(cd "$RUN" && TERM=vt100 exec setsid bochs -q -f "$RUN/bochsrc" -rc "$RUN/debugger.rc" </dev/null >"$RUN/bochs.out" 2>&1) &
BOCHS_PID=$!

# Stream the serial log: boot messages (stderr if verbose), then the program's
# output (stdout) until the exit marker.
exec 3<"$SERIAL"
phase=boot       # boot -> prog -> done
partial=""
rc=""
handle_line() {
    local line=${1%$'\r'}
    line=${line%$'\r'}
    case $phase in
        boot)
            if [[ $line == "$START_MARK"* ]]; then
                phase=prog; T_BOOT=$(date +%s.%N); return
            fi
            [[ $VERBOSE == 1 ]] && printf '[boot] %s\n' "$line" >&2
            ;;
        prog)
            if [[ $line =~ ^(.*)"$EXIT_MARK "(-?[0-9]+)$ ]]; then
                [[ -n ${BASH_REMATCH[1]} ]] && printf '%s\n' "${BASH_REMATCH[1]}"
                rc=${BASH_REMATCH[2]}; phase=done; return
            fi
            printf '%s\n' "$line"
            ;;
    esac
    if [[ $line == *"Kernel panic - not syncing"* ]]; then panicked=1; fi
}
pump() {
    local line
    while [[ $phase != done ]]; do
        if IFS= read -r line <&3; then
            handle_line "$partial$line"; partial=""
        else
            partial+=$line; break
        fi
    done
}

status=""
T_BOOT=""
panicked=0
deadline=$(( $(date +%s) + TIMEOUT ))
while :; do
    pump
    if [[ $phase == done ]]; then status=done; break; fi
    if [[ $panicked == 1 ]]; then sleep 1; pump; status=guest-panic; break; fi
    if ! kill -0 "$BOCHS_PID" 2>/dev/null; then
        pump; [[ -n $partial ]] && handle_line "$partial"
        [[ $phase == done ]] && status=done || status=bochs-exited
        break
    fi
    if (( $(date +%s) >= deadline )); then status=timeout; break; fi
    sleep 0.2
done
T_END=$(date +%s.%N)
[[ -n $T_BOOT ]] || T_BOOT=$T_END
exec 3<&-

if kill -0 "$BOCHS_PID" 2>/dev/null; then
    sleep 0.5   # give the guest a moment to power off by itself
    kill "$BOCHS_PID" 2>/dev/null || true
    for _ in $(seq 1 20); do kill -0 "$BOCHS_PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$BOCHS_PID" 2>/dev/null || true
fi
wait "$BOCHS_PID" 2>/dev/null || true
BOCHS_PID=

boot_s=$(awk -v a="$T0" -v b="$T_BOOT" 'BEGIN { printf "%.1f", b - a }')
run_s=$(awk -v a="$T_BOOT" -v b="$T_END" 'BEGIN { printf "%.1f", b - a }')

show_diag() {
    echo "----- guest serial log (last 40 lines) -----" >&2
    tr -d '\r' < "$SERIAL" | tail -n 40 >&2 || true
    echo "----- bochs output (last 20 lines) -----" >&2
    tail -n 20 "$RUN/bochs.out" >&2 || true
    [[ -f $RUN/bochs.log ]] && { echo "----- bochs.log (last 20 lines) -----" >&2; tail -n 20 "$RUN/bochs.log" >&2; } || true
}

case $status in
    done)
        log "boot ${boot_s}s, run ${run_s}s, exit status $rc"
        exit "$rc"
        ;;
    timeout)
        log "TIMEOUT after ${TIMEOUT}s (boot ${boot_s}s)"
        show_diag; exit 124 ;;
    *)
        log "harness failure: $status (boot ${boot_s}s, run ${run_s}s)"
        show_diag; exit 125 ;;
esac
