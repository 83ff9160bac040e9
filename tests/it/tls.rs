//! gRPC over TLS, and mTLS with client certificates, with certificates
//! generated for the test (rcgen).

use crate::common::*;
use kv_indexer::proto::kvindexer::v1 as pb;
use pb::kv_indexer_client::KvIndexerClient;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

struct Pki {
    dir: tempfile::TempDir,
    ca_pem: String,
    client_cert: String,
    client_key: String,
    /// A client certificate from a CA the server does not trust.
    rogue_cert: String,
    rogue_key: String,
}

fn ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

fn leaf(issuer: &CertifiedIssuer<'static, KeyPair>, names: &[&str]) -> (String, String) {
    let key = KeyPair::generate().unwrap();
    let params =
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let ca = ca("kv-indexer test CA");
    let (server_cert, server_key) = leaf(&ca, &["localhost"]);
    let (client_cert, client_key) = leaf(&ca, &["epp"]);
    let (rogue_cert, rogue_key) = leaf(&ca_rogue(), &["rogue"]);
    std::fs::write(dir.path().join("server.pem"), server_cert).unwrap();
    std::fs::write(dir.path().join("server.key"), server_key).unwrap();
    std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
    Pki {
        ca_pem: ca.pem(),
        dir,
        client_cert,
        client_key,
        rogue_cert,
        rogue_key,
    }
}

fn ca_rogue() -> CertifiedIssuer<'static, KeyPair> {
    ca("someone else's CA")
}

async fn client(
    service: &Service,
    pki: &Pki,
    identity: Option<(&str, &str)>,
) -> Result<KvIndexerClient<Channel>, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&pki.ca_pem))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let channel = Channel::from_shared(format!("https://localhost:{}", service.grpc_port))
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(KvIndexerClient::new(channel))
}

fn request() -> pb::ScoreRequest {
    pb::ScoreRequest {
        model: "m".into(),
        input: Some(pb::score_request::Input::TokenIds(pb::TokenIds {
            ids: vec![1; 32],
        })),
        ..Default::default()
    }
}

fn path(pki: &Pki, f: &str) -> String {
    pki.dir.path().join(f).display().to_string()
}

#[tokio::test]
async fn grpc_over_tls_serves_tls_clients_only() {
    let pki = pki();
    let (cert, key) = (path(&pki, "server.pem"), path(&pki, "server.key"));
    let service = Service::start(&["--tls-cert", &cert, "--tls-key", &key]).await;
    let mut c = client(&service, &pki, None).await.expect("TLS connect");
    assert_eq!(
        c.score(request())
            .await
            .expect("Score")
            .into_inner()
            .total_blocks,
        2
    );
    // A plaintext client gets nowhere.
    let plain = KvIndexerClient::connect(format!("http://127.0.0.1:{}", service.grpc_port)).await;
    if let Ok(mut plain) = plain {
        assert!(plain.score(request()).await.is_err());
    }
}

#[tokio::test]
async fn mtls_requires_a_client_certificate_from_the_trusted_ca() {
    let pki = pki();
    let (cert, key, ca) = (
        path(&pki, "server.pem"),
        path(&pki, "server.key"),
        path(&pki, "ca.pem"),
    );
    let service = Service::start(&[
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--tls-client-ca",
        &ca,
    ])
    .await;
    let mut trusted = client(&service, &pki, Some((&pki.client_cert, &pki.client_key)))
        .await
        .expect("mTLS connect");
    assert!(trusted.score(request()).await.is_ok());
    for identity in [
        None,
        Some((pki.rogue_cert.as_str(), pki.rogue_key.as_str())),
    ] {
        match client(&service, &pki, identity).await {
            Err(_) => {}
            Ok(mut c) => assert!(
                c.score(request()).await.is_err(),
                "{identity:?} must be refused"
            ),
        }
    }
}

/// Replicas over mTLS: B copies A's index over TLS, presenting its own
/// certificate (the server's, from the fleet's CA) and trusting
/// `--tls-client-ca`, with the fleet's secret. A replica with a certificate
/// from another CA gets nothing and starts empty.
#[tokio::test]
async fn replicas_copy_each_other_over_mtls() {
    let pki = pki();
    let path = |f: &str| pki.dir.path().join(f).to_str().unwrap().to_owned();
    let (cert, key, ca) = (path("server.pem"), path("server.key"), path("ca.pem"));
    let token = path("token");
    std::fs::write(&token, "fleet-secret\n").unwrap();
    let tls = [
        "--tls-cert",
        cert.as_str(),
        "--tls-key",
        key.as_str(),
        "--tls-client-ca",
        ca.as_str(),
        "--peer-token-file",
        token.as_str(),
    ];
    let a = Service::start(&tls).await;
    let peer = format!("localhost:{}", a.grpc_port);
    let mut b_args = tls.to_vec();
    b_args.extend(["--peer", peer.as_str()]);
    let b = Service::start(&b_args).await;
    assert_eq!(
        b.metric("kv_indexer_started_from{from=\"peer\"}"),
        1.0,
        "{}",
        b.logs()
    );

    // Another fleet's certificate: the TLS handshake refuses it.
    let rogue = ca_rogue();
    let (rogue_cert, rogue_key) = leaf(&rogue, &["localhost"]);
    std::fs::write(path("rogue.pem"), rogue_cert).unwrap();
    std::fs::write(path("rogue.key"), rogue_key).unwrap();
    std::fs::write(path("rogue-ca.pem"), rogue.pem()).unwrap();
    let (rc, rk, rca) = (path("rogue.pem"), path("rogue.key"), path("rogue-ca.pem"));
    let c = Service::start(&[
        "--tls-cert",
        &rc,
        "--tls-key",
        &rk,
        "--tls-client-ca",
        &rca,
        "--peer-token-file",
        &token,
        "--peer",
        &peer,
        "--peer-wait",
        "1s",
    ])
    .await;
    assert_eq!(
        c.metric("kv_indexer_started_from{from=\"empty\"}"),
        1.0,
        "{}",
        c.logs()
    );
}
