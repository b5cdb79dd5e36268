//! `tandem-router`: the router as its own process. `tandem-router --help` lists every flag.

use clap::Parser;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "tandem-router",
    version,
    about = "tandem router: OpenAI-compatible HTTP and gRPC front door for a prefill/decode cluster"
)]
struct Cli {
    #[command(flatten)]
    router: router::Args,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    cli.router.log.init();
    router::run(cli.router).await?;
    Ok(())
}
