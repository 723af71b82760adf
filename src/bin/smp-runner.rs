//! `smp-runner`: execute a plan (to be filled).

fn main() {
    eprintln!("smp-runner: not yet implemented");
    std::process::exit(2);
}
