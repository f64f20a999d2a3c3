//! The `k3ring` binary: parses arguments, runs the command, maps errors to exit codes.

fn main() -> std::process::ExitCode {
    k3ring::cli::main()
}
