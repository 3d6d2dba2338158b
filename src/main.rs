use clap::Parser;

fn main() {
    let cli = memtrain::cli::Cli::parse();
    std::process::exit(memtrain::app::main(cli));
}
