#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The private PostgreSQL instance the PostgreSQL store tests run on: a
//! real server on loopback, durable (`fsync` on), private to the test, and
//! gone when the test ends.

use rvbox_testkit::Postgres;

#[test]
fn a_private_instance_serves_sql_and_goes_away() {
    let pg = Postgres::start();
    assert_eq!(pg.psql("postgres", "SHOW fsync"), "on");
    assert_eq!(pg.psql("postgres", "SHOW listen_addresses"), "127.0.0.1");
    let major: u32 = pg
        .psql("postgres", "SHOW server_version_num")
        .parse()
        .unwrap();
    assert!(major >= 150_000, "PostgreSQL 15 or newer: {major}");
    pg.psql("postgres", "CREATE DATABASE rvbox");
    pg.psql(
        "rvbox",
        "CREATE TABLE t (k bigint PRIMARY KEY, v bytea NOT NULL)",
    );
    pg.psql("rvbox", "INSERT INTO t VALUES (1, '\\x00ff'), (2, '')");
    assert_eq!(
        pg.psql(
            "rvbox",
            "SELECT string_agg(k::text || ':' || encode(v, 'hex'), ',' ORDER BY k) FROM t"
        ),
        "1:00ff,2:"
    );
    // the data directory is private to the instance's user
    let meta = std::fs::metadata(pg.dir().join("data")).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(
        meta.permissions().mode() & 0o077,
        0,
        "group and others have no access"
    );
    let port = pg.port;
    let dir = pg.dir().to_path_buf();
    drop(pg);
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "stopped with the value"
    );
    assert!(!dir.exists(), "its directory removed");
}
