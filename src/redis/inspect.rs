//! The operator's calls on Redis: a snapshot of a key's lock or semaphore (inspect.lua),
//! and freeing it by force (force_release.lua), announced on the namespace's admin channel
//! so that the backend holding it re-checks its locks at once (see `admin.rs`).
//!
//! Each is one script on the key's names, which share a hash slot. The scripts are not
//! loaded or probed at build: a user allowed to lock need not be allowed these, and a
//! refusal is reported when the call is made, naming what was refused.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use redis::ScriptInvocation;
use tokio::time::timeout;

use super::UnexpectedReply;
use super::connection::command_error::{Refused, refused, refused_call};
use super::connection::pool::CommandError;
use super::keys::{LockKey, admin_channel};
use super::scripts::{self, millis};
use super::store::RedisStore;
use crate::core::store::replies;
use crate::error::LockError;
use crate::lock::inspect::{LockInfo, Primitive};

impl RedisStore {
    /// A snapshot of `key`'s lock or semaphore (see `LockBackend::inspect`).
    pub(super) async fn snapshot(
        self: Arc<Self>,
        key: String,
        of: Primitive,
    ) -> Result<LockInfo, LockError> {
        let names = self.names(key, of)?;
        let mut invocation = self.scripts.inspect.key(&*names.lock);
        invocation
            .key(&names.fence)
            .arg(u8::from(of == Primitive::Semaphore));
        let reply = self.run(Call::Inspect, &names, &invocation).await?;
        replies::snapshot(names.user, &reply)
            .ok_or_else(|| LockError::backend("inspect", UnexpectedReply("inspect")))
    }

    /// Frees `key`'s lock or semaphore and announces it (see
    /// `LockBackend::force_release`); returns what was freed.
    pub(super) async fn free_by_force(
        self: Arc<Self>,
        key: String,
        of: Primitive,
    ) -> Result<LockInfo, LockError> {
        let names = self.names(key, of)?;
        let mut invocation = self.scripts.force_release.key(&*names.lock);
        invocation
            .key(&names.fence)
            .arg(u8::from(of == Primitive::Semaphore))
            .arg(&names.channel)
            .arg(u8::from(self.scripts.sharded))
            .arg(millis(self.fence_ttl));
        if let Some(instance) = &self.resent_guard {
            let serial = self.force_serials.fetch_add(1, Ordering::Relaxed);
            invocation
                .key(names.releases())
                .arg(&**instance)
                .arg(serial);
        }
        let reply = self.run(Call::ForceRelease, &names, &invocation).await?;
        let freed = replies::snapshot(names.user, &reply)
            .ok_or_else(|| LockError::backend("inspect", UnexpectedReply("inspect")))?;
        if !freed.is_free() {
            self.announce_force_release().await;
        }
        Ok(freed)
    }

    /// The Redis names of `key`'s lock or semaphore, validated as an acquisition's are.
    fn names(&self, key: String, of: Primitive) -> Result<LockKey, LockError> {
        let names = match of {
            Primitive::Lock => LockKey::new(&self.namespace, key, self.max_key_len),
            Primitive::Semaphore => LockKey::semaphore(&self.namespace, key, self.max_key_len),
        };
        Ok(names?)
    }

    async fn run(
        &self,
        call: Call,
        names: &LockKey,
        invocation: &ScriptInvocation<'_>,
    ) -> Result<Vec<i64>, LockError> {
        let context = call.context();
        match timeout(self.command_timeout, self.pool.invoke(invocation)).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) if e.is_foreign_value() => Err(LockError::NotALock {
                key: names.user.clone(),
            }),
            Ok(Err(e)) => match refused(&e) {
                Some(what) => Err(LockError::backend(
                    context,
                    NotAllowed::new((call, self.scripts.sharded), what, names, e),
                )),
                None => Err(LockError::backend(context, e)),
            },
            Err(elapsed) => Err(LockError::backend(context, elapsed)),
        }
    }

    /// Tells every backend of the namespace that a lock was force-released: each re-checks
    /// the locks it holds, so the old holder sees `lost()` now rather than at its next
    /// renewal. Done after the script (a re-check before it would find the lock still
    /// held); if it fails, the holder learns at that renewal, as the docs promise.
    async fn announce_force_release(&self) {
        let publish = if self.scripts.sharded {
            "SPUBLISH"
        } else {
            "PUBLISH"
        };
        let mut announce = redis::cmd(publish);
        announce
            .arg(admin_channel(&self.namespace))
            .arg("force-released");
        let sent = timeout(self.command_timeout, self.pool.query::<i64>(&announce)).await;
        let error = match sent {
            Ok(Ok(_)) => return,
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out".to_owned(),
        };
        tracing::warn!(
            %error,
            "could not announce a force-release; its holder sees lost() at its next renewal"
        );
    }
}

/// An operator call, for errors.
#[derive(Debug, Clone, Copy)]
enum Call {
    Inspect,
    ForceRelease,
}

impl Call {
    fn context(self) -> &'static str {
        match self {
            Call::Inspect => "inspect",
            Call::ForceRelease => "force_release",
        }
    }

    /// The script's name in words, and its source.
    fn script(self) -> (&'static str, &'static str) {
        match self {
            Call::Inspect => ("inspect", scripts::INSPECT),
            Call::ForceRelease => ("force-release", scripts::FORCE_RELEASE),
        }
    }
}

/// Redis refused an operator call for lack of rights. The backend was built all the same:
/// taking and releasing locks needs fewer.
#[derive(Debug)]
struct NotAllowed {
    right: String,
    source: CommandError,
}

impl NotAllowed {
    fn new(
        (call, sharded): (Call, bool),
        what: Refused,
        names: &LockKey,
        source: CommandError,
    ) -> Self {
        let right = match what {
            Refused::Channel => format!("publish to channel `{}`", names.channel),
            Refused::Key => format!("access key `{}`", names.lock),
            Refused::Command => {
                let (name, script) = call.script();
                refused_call(&source, name, script, sharded)
            }
        };
        NotAllowed { right, source }
    }
}

impl fmt::Display for NotAllowed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the Redis ACL user may not {}", self.right)
    }
}

impl std::error::Error for NotAllowed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}
