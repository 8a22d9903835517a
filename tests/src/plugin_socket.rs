//! Dialling a plugin's unix socket the way kubelet does: gRPC over HTTP/2 on the socket (the
//! URI is a placeholder; the connector ignores it).

use std::path::Path;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

/// One attempt to open a gRPC channel to the plugin's unix socket at `socket`; a socket that is
/// missing or that nothing serves is an error.
///
/// # Errors
/// The transport's error when the socket cannot be connected or HTTP/2 cannot be set up on it.
pub async fn dial(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let socket = socket.to_owned();
    Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(
                    tokio::net::UnixStream::connect(socket).await?,
                ))
            }
        }))
        .await
}
