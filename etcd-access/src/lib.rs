//! How toolgate's programs reach a secured etcd: TLS with the CA that signed etcd's certificate,
//! a client certificate for etcd's `--client-cert-auth`, and an etcd user whose password comes
//! from a file or an environment variable (never from the command line, where `ps` shows it).
//! toolgate-xds and toolgate-register take the same flags, defined once here.

use std::path::{Path, PathBuf};

use etcd_client::{Certificate, ConnectOptions, Identity, TlsOptions};

/// The flags, for `#[command(flatten)]`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct EtcdAccessArgs {
    /// CA certificate (PEM) that signed etcd's server certificate. Turns TLS on: the etcd
    /// endpoints must then be https:// URLs.
    #[arg(long, value_name = "PEM")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for an etcd started with --client-cert-auth; needs --etcd-key
    /// and --etcd-ca.
    #[arg(long, value_name = "PEM", requires_all = ["etcd_key", "etcd_ca"])]
    pub etcd_cert: Option<PathBuf>,
    /// Private key (PEM) of --etcd-cert.
    #[arg(long, value_name = "PEM", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user, for an etcd with authentication enabled. The password comes from
    /// --etcd-password-file or --etcd-password-env.
    #[arg(long, value_name = "NAME")]
    pub etcd_user: Option<String>,
    /// File holding the etcd user's password (a trailing newline is ignored).
    #[arg(
        long,
        value_name = "FILE",
        requires = "etcd_user",
        conflicts_with = "etcd_password_env"
    )]
    pub etcd_password_file: Option<PathBuf>,
    /// Name of the environment variable holding the etcd user's password.
    #[arg(long, value_name = "VAR", requires = "etcd_user")]
    pub etcd_password_env: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AccessError {
    #[error("reading the {what} {path}: {reason}")]
    Read {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("--etcd-user {0} needs a password: give --etcd-password-file or --etcd-password-env")]
    NoPassword(String),
    #[error("the etcd password in {0} is empty")]
    EmptyPassword(String),
    #[error("--etcd-password-env {0}: the variable is not set (or not UTF-8)")]
    MissingVariable(String),
    #[error("etcd endpoint {0}: with --etcd-ca every endpoint must be an https:// URL")]
    NotHttps(String),
    #[error("etcd endpoint {0} is https:// but no --etcd-ca says which CA to trust")]
    NoCa(String),
}

/// What a client needs to reach etcd: built once at start, applied to every connection.
#[derive(Debug, Clone, Default)]
pub struct EtcdAccess {
    tls: Option<TlsOptions>,
    client_cert: bool,
    user: Option<(String, String)>,
}

impl EtcdAccessArgs {
    /// Reads the certificate, key and password files and the password variable; every error
    /// names the file or variable it is about.
    pub fn load(&self) -> Result<EtcdAccess, AccessError> {
        self.load_with(|name| std::env::var(name).ok())
    }

    fn load_with(&self, env: impl Fn(&str) -> Option<String>) -> Result<EtcdAccess, AccessError> {
        let tls = match &self.etcd_ca {
            Some(ca) => {
                let mut tls = TlsOptions::new()
                    .ca_certificate(Certificate::from_pem(read("CA certificate", ca)?));
                if let (Some(cert), Some(key)) = (&self.etcd_cert, &self.etcd_key) {
                    tls = tls.identity(Identity::from_pem(
                        read("client certificate", cert)?,
                        read("client key", key)?,
                    ));
                }
                Some(tls)
            }
            None => None,
        };
        let user = match &self.etcd_user {
            None => None,
            Some(user) => {
                let (password, source) = match (&self.etcd_password_file, &self.etcd_password_env) {
                    (Some(file), _) => {
                        let bytes = read("password file", file)?;
                        let text = String::from_utf8(bytes).map_err(|_| AccessError::Read {
                            what: "password file",
                            path: file.clone(),
                            reason: "not UTF-8".into(),
                        })?;
                        (text, file.display().to_string())
                    }
                    (None, Some(var)) => (
                        env(var).ok_or_else(|| AccessError::MissingVariable(var.clone()))?,
                        format!("${var}"),
                    ),
                    (None, None) => return Err(AccessError::NoPassword(user.clone())),
                };
                let password = password.trim_end_matches(['\n', '\r']).to_string();
                if password.is_empty() {
                    return Err(AccessError::EmptyPassword(source));
                }
                Some((user.clone(), password))
            }
        };
        Ok(EtcdAccess {
            tls,
            client_cert: self.etcd_cert.is_some(),
            user,
        })
    }
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, AccessError> {
    std::fs::read(path).map_err(|e| AccessError::Read {
        what,
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

impl EtcdAccess {
    /// Plain HTTP, no user: an etcd on loopback or a trusted network.
    pub fn none() -> EtcdAccess {
        EtcdAccess::default()
    }

    /// Checks that the endpoints' schemes match the TLS setting, before anything connects: a
    /// mismatch would otherwise show as a vague transport error much later.
    pub fn check_endpoints(&self, endpoints: &[String]) -> Result<(), AccessError> {
        for e in endpoints {
            let https = e.starts_with("https://");
            match (&self.tls, https) {
                (Some(_), false) => return Err(AccessError::NotHttps(e.clone())),
                (None, true) => return Err(AccessError::NoCa(e.clone())),
                _ => {}
            }
        }
        Ok(())
    }

    /// `opts` with TLS and the user set; token refresh on, so a session outlives etcd's token TTL.
    pub fn apply(&self, mut opts: ConnectOptions) -> ConnectOptions {
        if let Some(tls) = &self.tls {
            opts = opts.with_tls(tls.clone());
        }
        if let Some((user, password)) = &self.user {
            opts = opts
                .with_user(user.clone(), password.clone())
                .with_auto_token_refresh(true);
        }
        opts
    }

    /// The etcd user, if any.
    pub fn user(&self) -> Option<&str> {
        self.user.as_ref().map(|(u, _)| u.as_str())
    }

    /// For the start-up log line (never the password).
    pub fn describe(&self) -> String {
        let transport = match (&self.tls, self.client_cert) {
            (None, _) => "plain HTTP",
            (Some(_), false) => "TLS",
            (Some(_), true) => "TLS with a client certificate",
        };
        match &self.user {
            Some((user, _)) => format!("{transport}, user {user}"),
            None => transport.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        access: EtcdAccessArgs,
    }

    fn parse(args: &[&str]) -> Result<EtcdAccessArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("x").chain(args.iter().copied())).map(|c| c.access)
    }

    fn temp(name: &str, content: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("etcd-access-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join(name);
        std::fs::write(&path, content).expect("write");
        path
    }

    #[test]
    fn no_flags_is_plain_http_and_refuses_https_endpoints() {
        let access = parse(&[]).expect("parses").load().expect("loads");
        assert_eq!(access.describe(), "plain HTTP");
        assert!(access
            .check_endpoints(&["http://127.0.0.1:2379".into()])
            .is_ok());
        assert_eq!(
            access.check_endpoints(&["https://10.0.0.1:2379".into()]),
            Err(AccessError::NoCa("https://10.0.0.1:2379".into()))
        );
    }

    #[test]
    fn the_password_comes_from_a_file_or_a_variable_never_a_flag() {
        assert!(parse(&["--etcd-password", "x"]).is_err(), "no such flag");
        assert!(
            parse(&["--etcd-password-file", "/x"]).is_err(),
            "needs a user"
        );
        let file = temp("pw", "s3cret\n");
        let args = parse(&[
            "--etcd-user",
            "reg",
            "--etcd-password-file",
            &file.to_string_lossy(),
        ])
        .expect("parses");
        let access = args.load().expect("loads");
        assert_eq!(access.user, Some(("reg".into(), "s3cret".into())));
        assert_eq!(access.describe(), "plain HTTP, user reg");
        let args = parse(&["--etcd-user", "reg", "--etcd-password-env", "PW"]).expect("parses");
        let env = |v: &str| (v == "PW").then(|| "from-env".to_string());
        assert_eq!(
            args.load_with(env).expect("loads").user,
            Some(("reg".into(), "from-env".into()))
        );
        assert_eq!(
            args.load_with(|_| None).unwrap_err(),
            AccessError::MissingVariable("PW".into())
        );
        assert_eq!(
            parse(&["--etcd-user", "reg"])
                .expect("parses")
                .load()
                .unwrap_err(),
            AccessError::NoPassword("reg".into())
        );
        let empty = temp("empty", "\n");
        let err = parse(&[
            "--etcd-user",
            "reg",
            "--etcd-password-file",
            &empty.to_string_lossy(),
        ])
        .expect("parses")
        .load()
        .unwrap_err();
        assert!(matches!(err, AccessError::EmptyPassword(_)), "{err}");
    }

    #[test]
    fn a_missing_file_is_named() {
        let err = parse(&["--etcd-ca", "/nonexistent/ca.pem"])
            .expect("parses")
            .load()
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("CA certificate /nonexistent/ca.pem"),
            "{err}"
        );
        assert!(
            parse(&["--etcd-cert", "/c.pem"]).is_err(),
            "a certificate needs its key and CA"
        );
    }

    #[test]
    fn tls_needs_https_endpoints() {
        let ca = temp(
            "ca.pem",
            "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n",
        );
        let access = parse(&["--etcd-ca", &ca.to_string_lossy()])
            .expect("parses")
            .load()
            .expect("loads");
        assert_eq!(access.describe(), "TLS");
        assert_eq!(
            access.check_endpoints(&["127.0.0.1:2379".into()]),
            Err(AccessError::NotHttps("127.0.0.1:2379".into()))
        );
    }
}
