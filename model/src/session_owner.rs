//! Who a session the gateway holds with a server belongs to. The filter (its shared-data slots)
//! and toolgate-xds (its upstream-session table) must name an owner the same way, or a
//! client's held sessions would be looked up under one name and deleted under another.

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
}

impl OwnerKind {
    fn tag(self) -> char {
        match self {
            OwnerKind::Gateway => 'g',
            OwnerKind::Route => 's',
        }
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
}
