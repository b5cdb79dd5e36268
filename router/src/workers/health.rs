//! Health and load polling: GetLoad on every worker each interval (GetInfo first for workers whose
//! fingerprint is not known yet, i.e. static discovery).

use std::sync::Arc;

use proto::v1::{InfoRequest, LoadRequest};
use tokio::sync::watch;
use tracing::{info, warn};

use super::{WorkerHandle, WorkerPool};
use cluster::WorkerRecord;
use proto::v1::WorkerRole;

pub(super) async fn run(pool: Arc<WorkerPool>, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(pool.settings.health_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        let workers = pool.snapshot();
        futures::future::join_all(workers.iter().map(|w| poll_once(pool.clone(), w.clone()))).await;
    }
}

pub(super) async fn poll_once(pool: Arc<WorkerPool>, w: Arc<WorkerHandle>) {
    let timeout = pool.settings.health_timeout;
    let role = w.role.name();
    let tls = pool.settings.handle.tls.is_some();
    if w.fingerprint().is_none() && !learn_info(&w, timeout, tls).await {
        w.on_poll_failure(pool.settings.health_failures);
        pool.metrics.worker_healthy.with_label_values(&[role, &w.id]).set(0);
        return;
    }
    let result = match w.role {
        WorkerRole::Prefill => {
            let mut c = w.prefill_client();
            tokio::time::timeout(timeout, c.get_load(LoadRequest {})).await
        }
        WorkerRole::Decode => {
            let mut c = w.decode_client();
            tokio::time::timeout(timeout, c.get_load(LoadRequest {})).await
        }
        // Discovery never yields a record without a role.
        WorkerRole::Unspecified => return,
    };
    match result {
        Ok(Ok(r)) => {
            let r = r.into_inner();
            let g = &pool.metrics.worker_load;
            g.with_label_values(&[role, &w.id, "running"]).set(r.running_requests.into());
            g.with_label_values(&[role, &w.id, "queued"]).set(r.queued_requests.into());
            g.with_label_values(&[role, &w.id, "queued_tokens"]).set(r.queued_tokens as i64);
            g.with_label_values(&[role, &w.id, "kv_blocks_free"]).set(r.kv_blocks_free.into());
            g.with_label_values(&[role, &w.id, "kv_blocks_total"]).set(r.kv_blocks_total.into());
            g.with_label_values(&[role, &w.id, "router_in_flight"]).set(w.in_flight().into());
            if !w.is_healthy() {
                info!(worker = %w.id, role, "worker healthy");
            }
            w.on_report(r);
            pool.metrics.worker_healthy.with_label_values(&[role, &w.id]).set(1);
        }
        Ok(Err(status)) => fail(&pool, &w, &super::status_reason(&status, tls)),
        Err(_) => fail(&pool, &w, "health poll timed out"),
    }
    pool.metrics.worker_breaker_open.with_label_values(&[role, &w.id]).set(i64::from(w.breaker.is_open()));
}

fn fail(pool: &WorkerPool, w: &WorkerHandle, why: &str) {
    let was = w.is_healthy();
    if w.on_poll_failure(pool.settings.health_failures) && was {
        warn!(worker = %w.id, role = %w.role, reason = why, "worker unhealthy");
    }
    pool.metrics.worker_healthy.with_label_values(&[w.role.name(), &w.id]).set(i64::from(w.is_healthy()));
}

/// GetInfo: learns id, fingerprint and capacity of a statically configured worker.
async fn learn_info(w: &WorkerHandle, timeout: std::time::Duration, tls: bool) -> bool {
    let res = match w.role {
        WorkerRole::Prefill => tokio::time::timeout(timeout, w.prefill_client().get_info(InfoRequest {})).await,
        WorkerRole::Decode => tokio::time::timeout(timeout, w.decode_client().get_info(InfoRequest {})).await,
        WorkerRole::Unspecified => return false,
    };
    let info = match res {
        Ok(Ok(i)) => i.into_inner(),
        Ok(Err(s)) => {
            warn!(worker = %w.id, address = %w.address, error = %super::status_reason(&s, tls), "GetInfo failed");
            return false;
        }
        Err(_) => return false,
    };
    match WorkerRecord::from_info(info, &w.address) {
        Ok(mut rec) if rec.role == w.role && rec.fingerprint.is_some() => {
            // Keep the discovery id so the pool can match the record to this handle.
            let reported_id = std::mem::replace(&mut rec.id, w.id.clone());
            info!(worker = %w.id, worker_id = %reported_id, role = %w.role, fingerprint = ?rec.fingerprint, "worker identified");
            w.update_record(rec);
            w.mark_info_learned();
            true
        }
        Ok(rec) => {
            warn!(worker = %w.id, expected = %w.role, got = %rec.role, "worker's GetInfo does not match its configured role or has no fingerprint");
            false
        }
        Err(e) => {
            warn!(worker = %w.id, error = %e, "bad GetInfo answer");
            false
        }
    }
}
