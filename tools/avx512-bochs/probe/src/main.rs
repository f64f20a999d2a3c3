fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    println!("avx512-probe: args={args:?}");
    if args.iter().any(|a| a == "--force") {
        // Execute the AVX-512 code without checking CPUID first: SIGILL on CPUs without it.
        let res = unsafe { avx512_probe::avx512_checks() };
        let ok = res.iter().all(|(_, ok)| *ok);
        println!("avx512-probe: forced checks {}", if ok { "PASS" } else { "FAIL" });
        std::process::exit(if ok { 0 } else { 1 });
    }
    let ok = avx512_probe::run_all(true);
    println!("avx512-probe: {}", if ok { "PASS" } else { "FAIL" });
    std::process::exit(if ok { 0 } else { 1 });
}
