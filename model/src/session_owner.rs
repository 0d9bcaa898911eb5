//! Who a session the gateway holds with a server belongs to. The filter (its shared-data slots)
//! and toolgate-xds (its upstream-session table) must name an owner the same way, or a
//! client's held sessions would be looked up under one name and deleted under another.
//!
//! An owner is its kind's letter and what names the client ([`owner_of`], [`owner_of_identity`]),
//! then, when the caller presented a valid token, [`IDENTITY_SEPARATOR`] and a digest of the
//! token's issuer and subject ([`bound_to`]; the filter computes the digest): two users never
//! share a held session, whatever else they state or send.

/// Characters of a sealed session id's tail that make its owner: the authentication tag, which
/// no two sealed ids share and no client can choose.
pub const OWNER_CHARS: usize = 43;

/// Whose sealed id a held session goes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnerKind {
    /// A gateway session of the aggregate endpoint (`tgv1.` ids of toolgate-xds).
    Gateway,
    /// A server session on a per-service route, sealed with the client's `initialize`
    /// parameters by the filter.
    Route,
    /// A 2026-07-28 client of the aggregate endpoint calling a server that needs a session:
    /// such a client has no session id, so its owner is the identity it states in each
    /// request's `_meta` ([`owner_of_identity`]). Clients stating the same identity share it,
    /// unless they present tokens of different users ([`bound_to`]).
    Stateless,
}

impl OwnerKind {
    fn tag(self) -> char {
        match self {
            OwnerKind::Gateway => 'g',
            OwnerKind::Route => 's',
            OwnerKind::Stateless => 'm',
        }
    }

    /// The kind of an owner these functions made.
    pub fn of(owner: &str) -> Option<OwnerKind> {
        [OwnerKind::Gateway, OwnerKind::Route, OwnerKind::Stateless]
            .into_iter()
            .find(|k| owner.starts_with(k.tag()))
    }
}

/// The owner of a sealed session id: its kind's letter and the id's last [`OWNER_CHARS`]
/// characters; `None` for an id too short, or not ASCII, to be one the gateway sealed.
pub fn owner_of(kind: OwnerKind, session_id: &str) -> Option<String> {
    if session_id.len() < OWNER_CHARS + 8 || !session_id.is_ascii() {
        return None;
    }
    let mut owner = String::with_capacity(1 + OWNER_CHARS);
    owner.push(kind.tag());
    owner.push_str(&session_id[session_id.len() - OWNER_CHARS..]);
    Some(owner)
}

/// The owner of the sessions held for stateless clients stating `identity` (the compact JSON
/// of the `initialize` parameters made from it): its kind's letter and a 128-bit hash, so the
/// owner is short whatever the identity weighs. Not a secret: any client may state any
/// identity, and then shares that identity's sessions, which is what the owner stands for;
/// with a verified token the owner is also bound to its user ([`bound_to`]), so only clients
/// of one user stating one identity share.
pub fn owner_of_identity(identity: &str) -> String {
    // Two FNV-1a passes with different offsets: 128 bits make an accidental collision of two
    // identities practically impossible; a chosen one gains nothing a chosen identity does not.
    let fnv = |offset: u64| {
        identity.bytes().fold(offset, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    };
    format!(
        "{}{:016x}{:016x}",
        OwnerKind::Stateless.tag(),
        fnv(0xcbf2_9ce4_8422_2325),
        fnv(0x6c62_272e_07bb_0142)
    )
}

/// Between an owner and the digest of the verified identity it is bound to.
pub const IDENTITY_SEPARATOR: char = '~';

/// The request header the filter puts on a client's GET stream of the aggregate endpoint (and
/// removes when there is no verified caller): the digest of the caller's verified identity,
/// so that toolgate-xds relays to that stream what the caller's own held sessions receive,
/// never another user's of the same client session.
pub const IDENTITY_HEADER: &str = "x-toolgate-held-identity";

/// Whether `digest` is one the filter makes (32 lowercase hexadecimal characters).
pub fn is_identity_digest(digest: &str) -> bool {
    digest.len() == 32
        && digest
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// `owner` bound to a verified identity (`identity`: a digest of the token's issuer and
/// subject, made of characters other than [`IDENTITY_SEPARATOR`]); `owner` itself without one.
pub fn bound_to(owner: String, identity: Option<&str>) -> String {
    match identity {
        Some(digest) => format!("{owner}{IDENTITY_SEPARATOR}{digest}"),
        None => owner,
    }
}

/// Whether `owner` is `base` (an [`owner_of`] answer), bound to some identity or to none: the
/// held sessions a client's session ending ends.
pub fn is_owner_of(owner: &str, base: &str) -> bool {
    owner
        .strip_prefix(base)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(IDENTITY_SEPARATOR))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_is_the_kind_and_the_tail_of_a_sealed_id() {
        assert_eq!(owner_of(OwnerKind::Gateway, "tgv1.short"), None);
        assert_eq!(owner_of(OwnerKind::Gateway, &"é".repeat(60)), None);
        let id = format!("tgv1.{}{}", "A".repeat(40), "B".repeat(OWNER_CHARS));
        let owner = owner_of(OwnerKind::Gateway, &id).expect("owner");
        assert_eq!(owner, format!("g{}", "B".repeat(OWNER_CHARS)));
        let route = owner_of(OwnerKind::Route, &id).expect("owner");
        assert_eq!(route, format!("s{}", "B".repeat(OWNER_CHARS)));
    }

    #[test]
    fn an_owner_bound_to_a_user_is_that_users_alone() {
        let base = format!("g{}", "B".repeat(OWNER_CHARS));
        let alice = bound_to(base.clone(), Some("aaaa"));
        let bob = bound_to(base.clone(), Some("bbbb"));
        assert_ne!(alice, bob);
        assert_eq!(bound_to(base.clone(), None), base);
        assert!(is_owner_of(&alice, &base) && is_owner_of(&bob, &base));
        assert!(is_owner_of(&base, &base));
        assert!(!is_owner_of(&format!("{base}C"), &base));
        assert!(!is_owner_of("gxyz", &base));
        assert_eq!(OwnerKind::of(&alice), Some(OwnerKind::Gateway));
    }

    #[test]
    fn a_stated_identity_names_one_short_owner_of_its_kind() {
        let a = owner_of_identity(r#"{"clientInfo":{"name":"a"}}"#);
        assert_eq!(a, owner_of_identity(r#"{"clientInfo":{"name":"a"}}"#));
        assert_ne!(a, owner_of_identity(r#"{"clientInfo":{"name":"b"}}"#));
        assert_eq!(a.len(), 33);
        assert_eq!(OwnerKind::of(&a), Some(OwnerKind::Stateless));
        assert_eq!(OwnerKind::of("gxyz"), Some(OwnerKind::Gateway));
        assert_eq!(OwnerKind::of("sxyz"), Some(OwnerKind::Route));
        assert_eq!(OwnerKind::of("client-1"), None);
    }
}
