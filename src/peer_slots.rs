//! Places per client address in a queue for expensive work (a password
//! check, a check of credentials with an upstream), so that one address
//! cannot fill the queue for everyone: past its share, it is refused at
//! once instead of queued.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;

/// Checks waiting or running, per client address (IPv4, or IPv6 address;
/// IPv4-mapped IPv6 counts as IPv4). A std mutex: held only to change a
/// count, never across an await.
pub struct PeerSlots {
    limit: usize,
    counts: Mutex<HashMap<IpAddr, usize>>,
}

/// One place in [`PeerSlots`], given back when dropped (also when the
/// future holding it is cancelled).
pub struct Slot<'a> {
    slots: &'a PeerSlots,
    peer: IpAddr,
}

impl PeerSlots {
    /// At most `limit` places per address.
    pub fn new(limit: usize) -> PeerSlots {
        PeerSlots { limit, counts: Mutex::default() }
    }

    /// A place for `peer`, unless it holds `limit` already.
    pub fn enter(&self, peer: IpAddr) -> Option<Slot<'_>> {
        let peer = peer.to_canonical();
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let count = counts.entry(peer).or_insert(0);
        if *count >= self.limit {
            return None;
        }
        *count += 1;
        Some(Slot { slots: self, peer })
    }

    /// Places `peer` holds now.
    pub fn held(&self, peer: IpAddr) -> usize {
        let counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        counts.get(&peer.to_canonical()).copied().unwrap_or(0)
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut counts = self.slots.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = counts.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_gets_its_share_and_gives_it_back() {
        let slots = PeerSlots::new(2);
        let a = IpAddr::from([127, 0, 0, 1]);
        let mapped = IpAddr::from(std::net::Ipv4Addr::new(127, 0, 0, 1).to_ipv6_mapped());
        let one = slots.enter(a).unwrap();
        let two = slots.enter(mapped).unwrap();
        assert!(slots.enter(a).is_none(), "the mapped form is the same address");
        assert!(slots.enter(IpAddr::from([127, 0, 0, 2])).is_some(), "another address has its own share");
        drop((one, two));
        assert_eq!(slots.held(a), 0);
    }
}
