//! What [`RedisClusterBackend::connect`](crate::RedisClusterBackend::connect)
//! checks before it makes a backend: the given nodes answer, run with
//! cluster support, are members of one cluster, and it serves every slot.
//! Read-only commands (`CLUSTER MYID`, `CLUSTER NODES`, `CLUSTER INFO`).

use std::time::Duration;

use lock_core::{BackendError, BackendErrorKind};
use redis::ConnectionInfo;

use crate::config::SetupError;
use crate::plumbing::errors::map_redis_error;

/// What one node says about its cluster.
struct View {
    node: String,
    id: String,
    members: Vec<String>,
    state: String,
}

pub(crate) async fn check_nodes(
    infos: &[ConnectionInfo],
    timeout: Duration,
) -> Result<(), SetupError> {
    let mut views = Vec::new();
    let mut last_error = None;
    for info in infos {
        let node = info.addr.to_string();
        match tokio::time::timeout(timeout, view(info, &node)).await {
            Ok(Ok(view)) => views.push(view),
            Ok(Err(Answer::NotACluster)) => return Err(SetupError::NotACluster { node }),
            Ok(Err(Answer::Failed(error))) => last_error = Some(error),
            Err(_) => last_error = Some(BackendError::timeout("connecting", timeout)),
        }
    }
    if views.is_empty() {
        let error = last_error.unwrap_or_else(|| {
            BackendError::message(BackendErrorKind::Unavailable, "no cluster node answered")
        });
        return Err(SetupError::Connect(error));
    }
    for view in &views {
        for other in &views {
            if !view.members.contains(&other.id) {
                return Err(SetupError::ClusterNodesDisagree {
                    node: view.node.clone(),
                    other: other.node.clone(),
                });
            }
        }
        if view.state != "ok" {
            return Err(SetupError::ClusterNotReady {
                node: view.node.clone(),
                state: view.state.clone(),
            });
        }
    }
    Ok(())
}

enum Answer {
    NotACluster,
    Failed(BackendError),
}

async fn view(info: &ConnectionInfo, node: &str) -> Result<View, Answer> {
    let failed = |e: redis::RedisError| Answer::Failed(map_redis_error(e));
    let client = redis::Client::open(info.clone()).map_err(failed)?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| Answer::Failed(BackendError::unavailable(e)))?;
    let id: String = match redis::cmd("CLUSTER")
        .arg("MYID")
        .query_async(&mut conn)
        .await
    {
        Ok(id) => id,
        Err(e) if e.to_string().contains("cluster support disabled") => {
            return Err(Answer::NotACluster)
        }
        Err(e) => return Err(failed(e)),
    };
    let nodes: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut conn)
        .await
        .map_err(failed)?;
    let info: String = redis::cmd("CLUSTER")
        .arg("INFO")
        .query_async(&mut conn)
        .await
        .map_err(failed)?;
    // `<id> <ip:port@cport> <flags> …`, one line per node it knows.
    let members = nodes
        .lines()
        .filter_map(|line| line.split(' ').next())
        .filter(|id| !id.is_empty())
        .map(str::to_owned)
        .collect();
    let state = info
        .lines()
        .find_map(|line| line.strip_prefix("cluster_state:"))
        .unwrap_or("unknown")
        .trim()
        .to_owned();
    Ok(View {
        node: node.to_owned(),
        id,
        members,
        state,
    })
}
