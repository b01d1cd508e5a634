//! The cases, one `pub async fn` per behaviour, named after its id in the
//! contract. Each takes the backend factory, makes its own backend and key
//! namespace, and panics with a message that says what went wrong.

mod acquire;
mod admin;
mod cancel;
mod fair;
mod hold;
mod holding;
mod lost;
mod mutex;
mod outcome;
mod reentrancy;
mod reliability;
mod shutdown;
mod steps;
mod validity;

pub use acquire::*;
pub use admin::*;
pub use cancel::*;
pub use fair::*;
pub use hold::*;
pub use holding::*;
pub use lost::*;
pub use mutex::*;
pub use outcome::*;
pub use reentrancy::*;
pub use reliability::*;
pub use shutdown::*;
pub use steps::*;
pub use validity::*;
