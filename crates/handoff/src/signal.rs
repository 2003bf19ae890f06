//! Signals: the future that resolves on SIGTERM or ctrl-c (graceful
//! shutdown), shared by `handoff serve` and `handoff router`, and SIGHUP.

/// Resolves on the first SIGTERM or ctrl-c (logging which).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!("cannot listen for ctrl-c: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => tracing::info!("ctrl-c received: draining"),
        _ = term => tracing::info!("SIGTERM received: draining"),
    }
}

/// Call `each` on every SIGHUP, forever (`handoff serve`: a rolling restart
/// of its workers). Without SIGHUP (not unix, or it cannot be listened to)
/// it waits forever.
pub async fn on_hangup(each: impl Fn()) {
    #[cfg(unix)]
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(mut s) => {
            while s.recv().await.is_some() {
                each();
            }
        }
        Err(e) => tracing::warn!("cannot listen for SIGHUP: {e}"),
    }
    #[cfg(not(unix))]
    let _ = each;
    std::future::pending::<()>().await
}
