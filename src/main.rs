//! `tandem`: the command-line entry point.

fn main() {
    println!("tandem");
}
