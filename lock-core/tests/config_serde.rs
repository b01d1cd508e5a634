//! Configs load from a file or the environment: durations as "30s".

use std::time::Duration;

use lock_core::{LockConfig, LockerOptions, RetryAttempts};

#[test]
fn lock_config_reads_human_durations_and_keeps_defaults() {
    let config: LockConfig = serde_json::from_str(
        r#"{"ttl": "5s", "retry_attempts": "unlimited", "retry_delay": "50ms"}"#,
    )
    .unwrap();
    assert_eq!(config.ttl, Duration::from_secs(5));
    assert_eq!(config.retry_attempts, RetryAttempts::Unlimited);
    assert_eq!(config.retry_delay, Duration::from_millis(50));
    assert_eq!(config.retry_jitter, LockConfig::default().retry_jitter);
    assert!(config.validate().is_ok());

    let config: LockConfig = serde_json::from_str(r#"{"retry_attempts": 3}"#).unwrap();
    assert_eq!(config, LockConfig::default().retry_attempts(3));
    let config: LockConfig = serde_json::from_str("{}").unwrap();
    assert_eq!(config, LockConfig::default());

    let back: LockConfig = serde_json::from_str(&serde_json::to_string(&config).unwrap()).unwrap();
    assert_eq!(back, config);
}

#[test]
fn bad_config_files_are_refused_with_the_field_named() {
    for (text, needle) in [
        (r#"{"ttl": "5 parsecs"}"#, "expected a duration"),
        (r#"{"retry_attempts": "sometimes"}"#, "sometimes"),
        (r#"{"retry_attempts": -1}"#, "negative"),
        (r#"{"tll": "5s"}"#, "unknown field `tll`"),
    ] {
        let err = serde_json::from_str::<LockConfig>(text)
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{text}: {err}");
    }
    // A value that parses but is out of range is refused by validate.
    let config: LockConfig = serde_json::from_str(r#"{"ttl": "1ms"}"#).unwrap();
    assert!(config.validate().is_err());
}

#[test]
fn locker_options_read_human_durations() {
    let options: LockerOptions =
        serde_json::from_str(r#"{"node_id": "web-1", "release_timeout": "250ms"}"#).unwrap();
    assert_eq!(
        options,
        LockerOptions::default()
            .node_id("web-1")
            .release_timeout(Duration::from_millis(250))
    );
}
