//! Compiles `proto/` with protox (pure Rust): no system `protoc` needed.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "kvindexer/v1/indexer.proto",
        "kvindexer/v1/peer.proto",
        "llmd/indexer/v1/indexer.proto",
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed=proto/{p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    // Served by gRPC reflection.
    std::fs::write(out.join("descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        // Decodes each message from one slice: see src/codec.rs.
        .codec_path("crate::codec::SliceCodec")
        // Hand-written for a fast packed decode: see src/token_ids.rs.
        .extern_path(".kvindexer.v1.TokenIds", "crate::token_ids::TokenIds")
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
