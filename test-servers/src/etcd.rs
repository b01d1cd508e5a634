//! etcd members on free loopback ports, to test against and to kill,
//! restart and stop.
//!
//! - [`EtcdCluster::start`] starts `n` members (1 for a single server, 3
//!   for the fault tests) of Debian's `etcd` 3.4 found on `PATH`, with
//!   their data on `/dev/shm` and `--heartbeat-interval 10
//!   --election-timeout 100`, so that a new leader is elected within
//!   about 100 ms and etcd's lease floor is 1 s.
//! - [`shared_server`] is one single-member cluster for the whole test
//!   process.
//!
//! Without `etcd` on `PATH` they panic, naming `.ci/install-etcd`: a test
//! without etcd fails, it never skips. Members are killed on drop, and a
//! watchdog kills a member whose test process died without dropping it.
//! Nothing here touches a process or a directory it did not make.
//!
//! A test makes its backend from [`EtcdCluster::endpoints`] (or
//! [`url`](EtcdCluster::url)); lock-etcd's own tests add a config with
//! short timeouts in `tests/common`.

use std::io;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::process::{free_port, scratch_dir, shm_base, Slot, Watched};

/// The root user [`EtcdCluster::enable_auth`] makes, as etcdctl's
/// `--user` takes it.
pub const ROOT: &str = "root:root-pw";

/// What a test without etcd says.
const INSTALL: &str = "etcd and etcdctl 3.4 must be on PATH for the lock-etcd tests: \
     run `.ci/install-etcd` and put the directory it prints on PATH \
     (`export PATH=\"$(.ci/install-etcd):$PATH\"`)";

/// The path of `program` on `PATH`.
///
/// # Panics
///
/// When it is not there, naming `.ci/install-etcd`.
pub fn binary(program: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| panic!("`{program}` is not on PATH. {INSTALL}"))
}

/// One member of an [`EtcdCluster`].
#[derive(Debug)]
struct Member {
    name: String,
    client_port: u16,
    args: Vec<String>,
    process: Slot,
}

/// etcd members of this process on free loopback ports, their data in a
/// scratch directory of their own on `/dev/shm` (removed on drop). Killed
/// on drop.
#[derive(Debug)]
pub struct EtcdCluster {
    dir: PathBuf,
    members: Vec<Member>,
}

impl EtcdCluster {
    /// Starts `n` members and waits until they have a leader.
    ///
    /// # Errors
    ///
    /// When a member cannot be started or no leader is elected within 20 s.
    ///
    /// # Panics
    ///
    /// When `etcd` is not on `PATH`.
    pub async fn start(n: usize) -> io::Result<Self> {
        let etcd = binary("etcd");
        let mut ports = Vec::new();
        for _ in 0..n {
            ports.push((free_port()?, free_port()?));
        }
        let dir = scratch_dir(&shm_base(), "etcd")?;
        let initial = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let token = format!("withlock-{:08x}", rand::random::<u32>());
        let members = ports
            .iter()
            .enumerate()
            .map(|(i, (client, peer))| {
                let name = format!("m{i}");
                let client_url = format!("http://127.0.0.1:{client}");
                let peer_url = format!("http://127.0.0.1:{peer}");
                let args = vec![
                    etcd.display().to_string(),
                    format!("--name={name}"),
                    format!("--data-dir={}", dir.join(&name).display()),
                    format!("--listen-client-urls={client_url}"),
                    format!("--advertise-client-urls={client_url}"),
                    format!("--listen-peer-urls={peer_url}"),
                    format!("--initial-advertise-peer-urls={peer_url}"),
                    format!("--initial-cluster={initial}"),
                    format!("--initial-cluster-token={token}"),
                    "--initial-cluster-state=new".to_owned(),
                    "--heartbeat-interval=10".to_owned(),
                    "--election-timeout=100".to_owned(),
                    "--logger=zap".to_owned(),
                    "--log-level=error".to_owned(),
                ];
                Member {
                    process: Slot::new(format!("member {i}")),
                    name,
                    client_port: *client,
                    args,
                }
            })
            .collect();
        let cluster = Self { dir, members };
        for i in 0..n {
            cluster.spawn(i)?;
        }
        cluster.wait_for_leader(Duration::from_secs(20)).await?;
        Ok(cluster)
    }

    fn spawn(&self, i: usize) -> io::Result<()> {
        let member = &self.members[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{}.log", member.name)))?;
        // The watchdog removes the data directory too if this process dies.
        let watched = Watched::spawn(
            Command::new(&member.args[0])
                .args(&member.args[1..])
                .stdout(log.try_clone()?)
                .stderr(log),
            &self.dir,
        )?;
        member.process.set(watched);
        Ok(())
    }

    /// How many members the cluster has.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the cluster has no member (never: `start` needs one).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The client URL of member `i`.
    pub fn endpoint(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.members[i].client_port)
    }

    /// The client URLs of every member.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.members.len()).map(|i| self.endpoint(i)).collect()
    }

    /// An `etcd://` URL naming every member.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client_port))
            .collect();
        format!("etcd://{}", hosts.join(","))
    }

    /// The process id of member `i`, while it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].process.pid()
    }

    /// Kills member `i` (SIGKILL); its data stays for a
    /// [`restart`](Self::restart).
    pub fn kill(&self, i: usize) {
        self.members[i].process.kill();
    }

    /// Starts member `i` again on its data, after a [`kill`](Self::kill).
    ///
    /// # Errors
    ///
    /// When it cannot be started.
    pub fn restart(&self, i: usize) -> io::Result<()> {
        self.kill(i);
        self.spawn(i)
    }

    /// Stops member `i` (SIGSTOP): its connections stay open, nothing is
    /// answered.
    ///
    /// # Errors
    ///
    /// When it is not running or the signal fails.
    pub fn pause(&self, i: usize) -> io::Result<()> {
        self.members[i].process.pause(&[])
    }

    /// Lets a [`pause`](Self::pause)d member `i` run again (SIGCONT).
    ///
    /// # Errors
    ///
    /// When it is not running or the signal fails.
    pub fn resume(&self, i: usize) -> io::Result<()> {
        self.members[i].process.resume()
    }

    /// The index of the leader as the running members see it, once every
    /// running member answering agrees on one.
    ///
    /// # Errors
    ///
    /// When none is elected within `limit`.
    pub async fn wait_for_leader(&self, limit: Duration) -> io::Result<usize> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Some(leader) = self.leader_now().await {
                return Ok(leader);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(io::Error::other(format!(
                    "no etcd leader within {limit:?}; logs in {}",
                    self.dir.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The leader's index, if the running members agree on one now.
    async fn leader_now(&self) -> Option<usize> {
        let mut ids = Vec::new();
        let mut leaders = Vec::new();
        for i in 0..self.members.len() {
            if self.pid(i).is_none() {
                ids.push(None);
                continue;
            }
            let status = async {
                let mut client = etcd_client::Client::connect([self.endpoint(i)], None).await?;
                client.status().await
            };
            match tokio::time::timeout(Duration::from_millis(500), status).await {
                Ok(Ok(status)) => {
                    ids.push(status.header().map(|h| h.member_id()));
                    leaders.push(status.leader());
                }
                _ => ids.push(None),
            }
        }
        let first = *leaders.first()?;
        if first == 0 || leaders.iter().any(|&l| l != first) {
            return None;
        }
        ids.iter().position(|id| *id == Some(first))
    }

    /// Runs `etcdctl` with `args` against every member, for tests that
    /// use etcd's own client.
    pub fn etcdctl(&self) -> Command {
        let mut command = Command::new(binary("etcdctl"));
        command
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", self.endpoints().join(",")));
        command
    }

    /// [`etcdctl`](Self::etcdctl) as `user` (`name:password`).
    pub fn etcdctl_as(&self, user: &str) -> Command {
        let mut command = self.etcdctl();
        command.arg(format!("--user={user}"));
        command
    }

    /// Runs `etcdctl` (as `user`, when given) with `args` to its end.
    ///
    /// # Errors
    ///
    /// When it cannot run or fails, with its stderr.
    pub fn run_etcdctl(&self, user: Option<&str>, args: &[&str]) -> io::Result<()> {
        let mut command = match user {
            Some(user) => self.etcdctl_as(user),
            None => self.etcdctl(),
        };
        let out = command.args(args).output()?;
        if out.status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "etcdctl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            )))
        }
    }

    /// Turns etcd's authentication on, with the user `root` (password
    /// [`ROOT`]'s), who may do anything.
    ///
    /// # Errors
    ///
    /// When etcdctl fails.
    pub fn enable_auth(&self) -> io::Result<()> {
        self.run_etcdctl(
            None,
            &["user", "add", "root:root-pw", "--interactive=false"],
        )?;
        self.run_etcdctl(None, &["auth", "enable"])
    }

    /// Adds the user `name` with password `<name>-pw` and the role
    /// `role`, granted `permission` (`read`, `write`, `readwrite`) on
    /// every key starting with each of `prefixes`, with the commands an
    /// operator types (as root, after [`enable_auth`](Self::enable_auth)):
    ///
    /// ```sh
    /// etcdctl role add ROLE
    /// etcdctl role grant-permission ROLE --prefix=true PERMISSION PREFIX
    /// etcdctl user add NAME:NAME-pw --interactive=false
    /// etcdctl user grant-role NAME ROLE
    /// ```
    ///
    /// # Errors
    ///
    /// When etcdctl fails.
    pub fn add_user(
        &self,
        name: &str,
        role: &str,
        permission: &str,
        prefixes: &[&str],
    ) -> io::Result<()> {
        let root = Some(ROOT);
        self.run_etcdctl(root, &["role", "add", role])?;
        for prefix in prefixes {
            self.run_etcdctl(
                root,
                &[
                    "role",
                    "grant-permission",
                    role,
                    "--prefix=true",
                    permission,
                    prefix,
                ],
            )?;
        }
        let password = format!("{name}:{name}-pw");
        self.run_etcdctl(root, &["user", "add", &password, "--interactive=false"])?;
        self.run_etcdctl(root, &["user", "grant-role", name, role])
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            // A stopped member must run again to die of SIGTERM; SIGKILL
            // needs no such help.
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

static SHARED: tokio::sync::OnceCell<EtcdCluster> = tokio::sync::OnceCell::const_new();

/// One single-member etcd for the whole test process, started at the
/// first call, killed by its watchdog when the process exits.
///
/// # Panics
///
/// When `etcd` is not on `PATH` or does not start.
pub async fn shared_server() -> &'static EtcdCluster {
    SHARED
        .get_or_init(|| async {
            EtcdCluster::start(1)
                .await
                .unwrap_or_else(|e| panic!("the test etcd did not start: {e}"))
        })
        .await
}
