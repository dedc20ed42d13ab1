//! The IPv4 addresses an IPv6 address carries, for the dial guard
//! ([`super::dial`]): a packet to such an address ends up at the IPv4
//! address inside it (through the kernel, a translator, a relay or a
//! tunnel), so the guard judges it by that address, never by the IPv6
//! prefix around it.
//!
//! | form | prefix | where the IPv4 address is |
//! |---|---|---|
//! | mapped (RFC 4291) | `::ffff:0:0/96` | the last 32 bits |
//! | translated (SIIT, RFC 2765) | `::ffff:0:0:0/96` | the last 32 bits |
//! | compatible (RFC 4291, deprecated) | `::/96` | the last 32 bits |
//! | NAT64 well-known (RFC 6052) | `64:ff9b::/96` | the last 32 bits |
//! | NAT64 local-use (RFC 8215) | `64:ff9b:1::/48` | every RFC 6052 layout a prefix inside it can have (below) |
//! | 6to4 (RFC 3056) | `2002::/16` | bits 16–47 |
//! | Teredo (RFC 4380) | `2001::/32` | the server in bits 32–63; the client in the last 32 bits, XOR `0xffffffff` |
//! | ISATAP (RFC 5214) | any, with the interface identifier `0:5efe` or `200:5efe` | the last 32 bits |
//!
//! NAT64 local-use: the operator carves a prefix of 48, 56, 64 or 96 bits
//! out of `64:ff9b:1::/48`, and RFC 6052 puts the IPv4 address at a place
//! that depends on that length (skipping bits 64–71), which nothing in the
//! address says. The guard does not assume one: it reads the address at
//! all four places and the address is judged by the strictest of them. At
//! the places of the /48, /56 and /64 layouts a reading in `0.0.0.0/8` is
//! skipped: every address of the common /96 layout (`64:ff9b:1::a.b.c.d`)
//! has zeros there, and no translator forwards to "this network". The /96
//! reading always counts.
//!
//! Not recognisable from the address alone, so judged as the IPv6 address
//! it is: a network-specific NAT64 prefix (RFC 6052) and 6rd (RFC 5969)
//! prefixes, both chosen by a network's operator. A network using them
//! keeps its translator or border relay from reaching the metadata
//! addresses (docs/security.md).

use std::net::{Ipv4Addr, Ipv6Addr};

/// Which way an IPv6 address carries an IPv4 one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    Mapped,
    Translated,
    Compatible,
    Nat64,
    Nat64LocalUse,
    SixToFour,
    Teredo,
    Isatap,
}

impl Form {
    pub fn name(self) -> &'static str {
        match self {
            Form::Mapped => "IPv4-mapped",
            Form::Translated => "IPv4-translated",
            Form::Compatible => "IPv4-compatible",
            Form::Nat64 => "NAT64",
            Form::Nat64LocalUse => "NAT64 local-use",
            Form::SixToFour => "6to4",
            Form::Teredo => "Teredo",
            Form::Isatap => "ISATAP",
        }
    }
}

/// The IPv4 addresses found in one IPv6 address (one, or more where the
/// form has more than one: Teredo's server and client, NAT64 local-use's
/// layouts).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Embedded {
    pub form: Form,
    pub addresses: Vec<Ipv4Addr>,
}

/// The IPv4 addresses `ip` carries, if it has a form that carries one.
/// `::` and `::1` carry none (they are the IPv6 unspecified and loopback
/// addresses, not compatible ones).
pub fn embedded(ip: Ipv6Addr) -> Option<Embedded> {
    let s = ip.segments();
    let o = ip.octets();
    let at = |i: usize| Ipv4Addr::new(o[i], o[i + 1], o[i + 2], o[i + 3]);
    let last = at(12);
    let one = |form| Some(Embedded { form, addresses: vec![last] });
    match s {
        [0, 0, 0, 0, 0, 0xffff, _, _] => one(Form::Mapped),
        [0, 0, 0, 0, 0xffff, 0, _, _] => one(Form::Translated),
        [0, 0, 0, 0, 0, 0, 0, 0 | 1] => None,
        [0, 0, 0, 0, 0, 0, _, _] => one(Form::Compatible),
        [0x64, 0xff9b, 0, 0, 0, 0, _, _] => one(Form::Nat64),
        [0x64, 0xff9b, 1, ..] => Some(Embedded { form: Form::Nat64LocalUse, addresses: local_use_layouts(o) }),
        [0x2002, ..] => Some(Embedded { form: Form::SixToFour, addresses: vec![at(2)] }),
        [0x2001, 0, ..] => {
            let client = Ipv4Addr::from(!u32::from(last));
            Some(Embedded { form: Form::Teredo, addresses: vec![at(4), client] })
        }
        [.., iid, 0x5efe, _, _] if iid & !0x0200 == 0 => one(Form::Isatap),
        _ => None,
    }
}

/// The readings of a NAT64 local-use address at every RFC 6052 layout a
/// prefix inside `64:ff9b:1::/48` can have (see the module's note).
fn local_use_layouts(o: [u8; 16]) -> Vec<Ipv4Addr> {
    // Bits 64–71 (octet 8) are the reserved "u" octet, skipped by every layout.
    let shorter = [
        Ipv4Addr::new(o[6], o[7], o[9], o[10]),   // /48
        Ipv4Addr::new(o[7], o[9], o[10], o[11]),  // /56
        Ipv4Addr::new(o[9], o[10], o[11], o[12]), // /64
    ];
    let mut found: Vec<Ipv4Addr> = shorter.into_iter().filter(|a| a.octets()[0] != 0).collect();
    found.push(Ipv4Addr::new(o[12], o[13], o[14], o[15])); // /96
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(s: &str) -> Option<(Form, Vec<String>)> {
        embedded(s.parse().unwrap()).map(|e| (e.form, e.addresses.iter().map(|a| a.to_string()).collect()))
    }

    fn one(form: Form, address: &str) -> Option<(Form, Vec<String>)> {
        Some((form, vec![address.to_owned()]))
    }

    #[test]
    fn each_form_gives_the_address_it_carries() {
        let cases = [
            ("::ffff:169.254.169.254", one(Form::Mapped, "169.254.169.254")),
            ("::ffff:a9fe:a9fe", one(Form::Mapped, "169.254.169.254")),
            ("::ffff:0:a9fe:a9fe", one(Form::Translated, "169.254.169.254")),
            ("::a9fe:a9fe", one(Form::Compatible, "169.254.169.254")),
            ("::127.0.0.1", one(Form::Compatible, "127.0.0.1")),
            ("64:ff9b::a9fe:a9fe", one(Form::Nat64, "169.254.169.254")),
            ("64:ff9b::169.254.169.254", one(Form::Nat64, "169.254.169.254")),
            ("2002:a9fe:a9fe::1", one(Form::SixToFour, "169.254.169.254")),
            ("2002:a9fe:a9fe:ffff:ffff:ffff:ffff:ffff", one(Form::SixToFour, "169.254.169.254")),
            ("2001:db8::5efe:a9fe:a9fe", one(Form::Isatap, "169.254.169.254")),
            ("2001:db8::200:5efe:a9fe:a9fe", one(Form::Isatap, "169.254.169.254")),
        ];
        for (address, want) in cases {
            assert_eq!(found(address), want, "{address}");
        }
    }

    #[test]
    fn teredo_gives_its_server_and_its_obfuscated_client() {
        // Server 203.0.113.7, client 169.254.169.254 (0xa9fea9fe ^ 0xffffffff).
        let (form, addresses) = found("2001:0:cb00:7107::5601:5601").unwrap();
        assert_eq!(form, Form::Teredo);
        assert_eq!(addresses, ["203.0.113.7", "169.254.169.254"]);
        let (_, addresses) = found("2001:0:a9fe:a9fe:8000:ffff:34ff:8ef8").unwrap();
        assert_eq!(addresses, ["169.254.169.254", "203.0.113.7"]);
    }

    #[test]
    fn nat64_local_use_is_read_at_every_layout() {
        // The /96 layout, as the example: shorter layouts read 0.x and are skipped.
        assert_eq!(found("64:ff9b:1::a9fe:a9fe"), one(Form::Nat64LocalUse, "169.254.169.254"));
        // 169.254.169.254 in the /48 layout: bits 48–63, then 72–87.
        let (_, at48) = found("64:ff9b:1:a9fe:a9:fe00::").unwrap();
        assert_eq!(at48, ["169.254.169.254", "254.169.254.0", "169.254.0.0", "0.0.0.0"]);
        // The /56 layout.
        let (_, at56) = found("64:ff9b:1:a9:fe:a9fe::").unwrap();
        assert!(at56.contains(&"169.254.169.254".to_owned()), "{at56:?}");
        // The /64 layout.
        let (_, at64) = found("64:ff9b:1:0:a9:fea9:fe00:0").unwrap();
        assert!(at64.contains(&"169.254.169.254".to_owned()), "{at64:?}");
        // An operator's /96 with bits of its own: every reading is kept.
        let (_, mine) = found("64:ff9b:1:ab00::808:808").unwrap();
        assert_eq!(mine, ["171.0.0.0", "8.8.8.8"]);
    }

    #[test]
    fn addresses_of_no_embedding_form_carry_nothing() {
        for address in ["::", "::1", "2606:4700::1111", "fd00:ec2::254", "fe80::1", "2001:db8::1", "64:ff9b:2::1"] {
            assert_eq!(found(address), None, "{address}");
        }
    }
}
