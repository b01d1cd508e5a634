//! The endpoint the backend talks to: one member at a time, pinned, and
//! the next one of the list when it stops answering.
//!
//! A client balancing over every endpoint keeps sending a share of the
//! requests to a member that is stopped (its connections stay open, it
//! answers nothing), each waiting out its timeout. So the backend keeps
//! one client on one endpoint, the first of the list to begin with. A
//! request that the pinned member leaves unanswered for the failover
//! timeout, or that fails on its connection (refused, reset, no leader),
//! moves the pin to the next endpoint, wrapping around; the keep-alive
//! and watch streams follow the pin. Each pin has a generation, so that
//! the many requests that notice one member's failure move the pin once.

use std::future::Future;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use lock_core::{BackendError, Background};
use tokio::sync::watch;
use tonic::Code;

use crate::error::{is_refusal, nothing_sent, step_error};

/// The client of one endpoint, and the generation of the pin it belongs
/// to.
#[derive(Clone)]
pub(crate) struct Pin {
    pub(crate) client: Client,
    pub(crate) generation: u64,
}

/// Whether a request may be sent again on the next endpoint after its
/// endpoint failed while it was under way.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Again {
    /// Sending it twice does no harm (a read, a keep-alive, a grant whose
    /// lease would only expire unused): it is sent again at once.
    Yes,
    /// Its outcome would be misread the second time (a conditional
    /// delete): it waits on, for the rest of its step, unless it surely
    /// did not leave (a refused connection).
    No,
}

pub(crate) struct Endpoints {
    /// Where the clients' connections live, and the backend's tasks run
    /// \[T1\].
    background: Background,
    urls: Vec<String>,
    options: ConnectOptions,
    failover_after: Duration,
    state: Mutex<State>,
    /// Serializes the making of a pinned endpoint's client.
    making: tokio::sync::Mutex<()>,
    switched: watch::Sender<u64>,
}

struct State {
    index: usize,
    generation: u64,
    /// The pinned endpoint's client, once made (clients are made when
    /// first needed after a switch: with credentials, making one logs in).
    client: Option<Client>,
    /// The last client made, for [`Endpoints::last_client`].
    last: Client,
}

impl Endpoints {
    /// Pins the first endpoint whose client can be made (without
    /// credentials, the first: its connection is made at its first
    /// request; with them, making a client logs in, within the failover
    /// timeout). A refusal of the credentials ends it at once. Clients
    /// are made inside `background`, so that their connections outlive
    /// the caller's runtime \[T1\].
    pub(crate) async fn connect(
        urls: Vec<String>,
        options: ConnectOptions,
        failover_after: Duration,
        background: Background,
    ) -> Result<Self, etcd_client::Error> {
        let mut last_error = None;
        for (index, url) in urls.iter().enumerate() {
            let made = tokio::time::timeout(
                failover_after,
                background.making(Client::connect([url], Some(options.clone()))),
            )
            .await;
            let client = match made {
                Ok(Ok(client)) => client,
                Ok(Err(error)) if is_refusal(&error) => return Err(error),
                Ok(Err(error)) => {
                    last_error = Some(error);
                    continue;
                }
                Err(_) => {
                    last_error = Some(no_login(url, failover_after));
                    continue;
                }
            };
            let (switched, _) = watch::channel(0);
            return Ok(Self {
                background,
                urls,
                options,
                failover_after,
                state: Mutex::new(State {
                    index,
                    generation: 0,
                    client: Some(client.clone()),
                    last: client,
                }),
                making: tokio::sync::Mutex::new(()),
                switched,
            });
        }
        Err(last_error.unwrap_or_else(|| etcd_client::Error::InvalidArgs("no endpoint".into())))
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The background runtime the backend's tasks run on.
    pub(crate) fn background(&self) -> &Background {
        &self.background
    }

    pub(crate) fn len(&self) -> usize {
        self.urls.len()
    }

    pub(crate) fn failover_after(&self) -> Duration {
        self.failover_after
    }

    /// The endpoint pinned now.
    pub(crate) fn pinned_url(&self) -> String {
        self.urls[self.state().index].clone()
    }

    /// The last client made: the pinned endpoint's, or the one before it
    /// while the pinned one's is being made.
    pub(crate) fn last_client(&self) -> Client {
        self.state().last.clone()
    }

    /// The generation of the pin now.
    pub(crate) fn generation(&self) -> u64 {
        self.state().generation
    }

    /// A receiver that sees each switch.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.switched.subscribe()
    }

    fn pinned(&self) -> Option<Pin> {
        let state = self.state();
        state.client.as_ref().map(|client| Pin {
            client: client.clone(),
            generation: state.generation,
        })
    }

    /// The pinned endpoint's client, made if need be (within the failover
    /// timeout; an endpoint whose client cannot be made is passed over).
    pub(crate) async fn pin(&self) -> Result<Pin, etcd_client::Error> {
        if let Some(pin) = self.pinned() {
            return Ok(pin);
        }
        let _making = self.making.lock().await;
        let mut tries = 0;
        loop {
            if let Some(pin) = self.pinned() {
                return Ok(pin);
            }
            let (url, generation) = {
                let state = self.state();
                (self.urls[state.index].clone(), state.generation)
            };
            let made = tokio::time::timeout(
                self.failover_after,
                self.background
                    .making(Client::connect([&url], Some(self.options.clone()))),
            )
            .await;
            let error = match made {
                Ok(Ok(client)) => {
                    let mut state = self.state();
                    if state.generation == generation {
                        state.client = Some(client.clone());
                        state.last = client;
                    }
                    continue;
                }
                Ok(Err(error)) if is_refusal(&error) => return Err(error),
                Ok(Err(error)) => error,
                Err(_) => no_login(&url, self.failover_after),
            };
            tracing::debug!(error = %lock_core::ErrorChain(&error), endpoint = %url, "no client on the etcd endpoint");
            self.failed(generation, &error);
            tries += 1;
            if tries >= self.urls.len() {
                return Err(error);
            }
        }
    }

    /// The endpoint of pin `generation` failed: the next one is pinned,
    /// unless another failure moved the pin already.
    pub(crate) fn failed(&self, generation: u64, why: &dyn std::fmt::Display) {
        let mut state = self.state();
        if state.generation != generation {
            return;
        }
        let from = state.index;
        state.index = (state.index + 1) % self.urls.len();
        state.generation += 1;
        state.client = None;
        let now = state.generation;
        drop(state);
        tracing::info!(
            from = %self.urls[from],
            to = %self.urls[(from + 1) % self.urls.len()],
            %why,
            "etcd endpoint failover"
        );
        self.switched.send_replace(now);
    }

    /// Sends one request on the pinned endpoint. One left unanswered for
    /// the failover timeout, or failing on its connection, moves the pin
    /// on; with [`Again::Yes`] it is then sent on the next endpoint, up
    /// to once per endpoint. The caller bounds the whole by its step
    /// timeout.
    pub(crate) async fn call<T, F, Fut>(&self, again: Again, mut send: F) -> Result<T, BackendError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let mut tries = 0;
        loop {
            tries += 1;
            let last_try = tries > self.urls.len();
            let pin = self.pin().await.map_err(step_error)?;
            let request = send(pin.client);
            tokio::pin!(request);
            match tokio::time::timeout(self.failover_after, &mut request).await {
                Ok(Ok(answer)) => return Ok(answer),
                Ok(Err(error)) if is_endpoint_failure(&error) => {
                    self.failed(pin.generation, &error);
                    let unsent = nothing_sent(&error);
                    if last_try || (again == Again::No && !unsent) {
                        return Err(step_error(error));
                    }
                }
                Ok(Err(error)) => return Err(step_error(error)),
                Err(_) => {
                    self.failed(
                        pin.generation,
                        &format_args!("no answer within {:?}", self.failover_after),
                    );
                    if again == Again::No || last_try {
                        // Its step's timeout ends the wait.
                        return request.await.map_err(step_error);
                    }
                }
            }
        }
    }
}

fn no_login(url: &str, after: Duration) -> etcd_client::Error {
    etcd_client::Error::GRpcStatus(tonic::Status::unavailable(format!(
        "{url} did not answer the login within {after:?}"
    )))
}

/// Whether `error` says the endpoint, not the request, failed: its
/// connection (refused, reset, broken), or a member without a leader.
pub(crate) fn is_endpoint_failure(error: &etcd_client::Error) -> bool {
    match error {
        etcd_client::Error::GRpcStatus(status) => match status.code() {
            Code::Unavailable | Code::Cancelled => true,
            Code::Unknown => {
                let message = status.message();
                message.contains("transport")
                    || message.contains("connection")
                    || message.contains("h2 protocol")
            }
            _ => false,
        },
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        _ => false,
    }
}
