//! `smp-partition`: plan a model (to be filled).

fn main() {
    eprintln!("smp-partition: not yet implemented");
    std::process::exit(2);
}
