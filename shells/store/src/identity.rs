//! Per-data-directory secrets and identity, generated once.
//!
//! - `token.key` (mode 0600): 32 random bytes that authenticate page and
//!   output tokens, so tokens survive restarts and a token from another
//!   data directory is refused (spec-mapping).
//! - `store_meta.server_id`: a UUIDv7 naming this server store; clients key
//!   their cursors and spool per server identity (spec-mapping R5).

use crate::db::Cached as _;
use std::io;
use std::path::Path;

use rusqlite::{Connection, OptionalExtension, params};

use crate::entropy::{Entropy, uuid_v7};
use crate::error::StoreError;
use crate::fs::StoreFs;

/// Length of the token key.
pub const TOKEN_KEY_LEN: usize = 32;

/// Reads the token key, creating it (exclusive create, fsync, directory
/// sync) on first use.
///
/// # Errors
/// [`StoreError::Io`] when the file cannot be read or created, or
/// [`StoreError::Layout`] when it exists with the wrong length.
pub fn token_key(
    fs: &dyn StoreFs,
    path: &Path,
    entropy: &dyn Entropy,
) -> Result<[u8; TOKEN_KEY_LEN], StoreError> {
    match fs.open(path) {
        Ok(f) => {
            let len = f
                .len()
                .map_err(|e| StoreError::io("read token key", path, e))?;
            if len != TOKEN_KEY_LEN as u64 {
                return Err(StoreError::Layout {
                    path: path.to_path_buf(),
                    reason: format!(
                        "token key is {len} bytes, expected {TOKEN_KEY_LEN}; restore it from backup or remove it to invalidate every outstanding page token"
                    ),
                });
            }
            let mut key = [0u8; TOKEN_KEY_LEN];
            f.read_exact_at(&mut key, 0)
                .map_err(|e| StoreError::io("read token key", path, e))?;
            Ok(key)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let mut key = [0u8; TOKEN_KEY_LEN];
            entropy
                .fill(&mut key)
                .map_err(|e| StoreError::io("generate token key", path, e))?;
            let mut f = fs
                .create_new(path)
                .map_err(|e| StoreError::io("create token key", path, e))?;
            f.append(&key)
                .and_then(|()| f.sync_data())
                .map_err(|e| StoreError::io("write token key", path, e))?;
            if let Some(dir) = path.parent() {
                fs.sync_dir(dir)
                    .map_err(|e| StoreError::io("sync data directory", dir, e))?;
            }
            Ok(key)
        }
        Err(e) => Err(StoreError::io("open token key", path, e)),
    }
}

/// Reads this store's server id, minting it on first open.
///
/// # Errors
/// [`StoreError::Sqlite`], or [`StoreError::Io`] when entropy fails.
pub fn server_id(
    conn: &Connection,
    entropy: &dyn Entropy,
    now_ms: i64,
) -> Result<[u8; 16], StoreError> {
    let found: Option<Vec<u8>> = conn
        .query_row_cached(
            "SELECT value FROM store_meta WHERE key = 'server_id'",
            [],
            |r| r.get(0),
        )
        .optional()
        .map_err(|e| StoreError::sqlite("read server id", e))?;
    if let Some(v) = found {
        return <[u8; 16]>::try_from(v.as_slice())
            .map_err(|_| StoreError::Integrity("store_meta.server_id is not 16 bytes".into()));
    }
    let id = uuid_v7(entropy, now_ms).map_err(|e| StoreError::io("mint server id", "", e))?;
    conn.execute_cached(
        "INSERT INTO store_meta (key, value) VALUES ('server_id', ?1)",
        params![id.as_slice()],
    )
    .map_err(|e| StoreError::sqlite("record server id", e))?;
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::{self, DbOptions};
    use crate::entropy::OsEntropy;
    use crate::fs::RealFs;

    #[test]
    fn token_key_is_created_once_private_and_checked() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("token.key");
        let a = token_key(&RealFs, &p, &OsEntropy).unwrap();
        let b = token_key(&RealFs, &p, &OsEntropy).unwrap();
        assert_eq!(a, b);
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        std::fs::write(&p, b"short").unwrap();
        assert!(matches!(
            token_key(&RealFs, &p, &OsEntropy),
            Err(StoreError::Layout { .. })
        ));
    }

    #[test]
    fn server_id_is_stable() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = db::open(&dir.path().join("t.sqlite3"), DbOptions::default()).unwrap();
        db::migrate(&mut c, 0).unwrap();
        let a = server_id(&c, &OsEntropy, 5).unwrap();
        assert_eq!(server_id(&c, &OsEntropy, 6).unwrap(), a);
    }
}
