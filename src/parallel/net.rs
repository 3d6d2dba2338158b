//! Which network device a Gloo rank talks to the other ranks through. Gloo's own default binds to
//! whatever this machine's hostname resolves to, which on a multi-node run can be an address the
//! other nodes cannot reach (Debian's 127.0.1.1, a container bridge); PyTorch's answer is
//! `GLOO_SOCKET_IFNAME`, and without it memtrain takes the address its route to `MASTER_ADDR`
//! leaves from, which the other nodes can reach whenever they can reach the rendezvous host's
//! network.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket};

use anyhow::{bail, Context, Result};

use crate::shim::dist::GlooDevice;

/// PyTorch's variable: comma-separated interface names, one Gloo device each.
pub const IFNAME: &str = "GLOO_SOCKET_IFNAME";

/// The device for a rank whose rendezvous is at `master:port`; `ifname` is `GLOO_SOCKET_IFNAME`.
pub fn gloo_device(ifname: Option<&str>, master: &str, port: u16) -> Result<GlooDevice> {
    match ifname.map(str::trim).filter(|v| !v.is_empty()) {
        Some(v) => interfaces(v, &existing_interfaces()),
        None => route_to(master, port).map(GlooDevice::Address),
    }
}

fn interfaces(value: &str, existing: &[String]) -> Result<GlooDevice> {
    interfaces_with(value, existing, &addressed_interfaces())
}

/// `existing`: the machine's interfaces; `addressed`: those with an IP address (Gloo binds to one).
fn interfaces_with(value: &str, existing: &[String], addressed: &[String]) -> Result<GlooDevice> {
    let names: Vec<String> = value
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .collect();
    if let Some(bad) = names.iter().find(|n| !existing.contains(n)) {
        bail!(
            "{IFNAME}={value:?}: this machine has no network interface {bad:?} (it has: {}); set it to the \
             interface the other nodes reach this one on, or unset it to use the one that reaches MASTER_ADDR",
            if existing.is_empty() {
                "none found in /sys/class/net".to_owned()
            } else {
                existing.join(", ")
            }
        );
    }
    if let Some(bare) = names.iter().find(|n| !addressed.contains(n)) {
        bail!(
            "{IFNAME}={value:?}: network interface {bare:?} has no IP address (it is down or unconfigured); \
             name one that has (with an address here: {}), or unset it to use the one that reaches MASTER_ADDR",
            if addressed.is_empty() {
                "none".to_owned()
            } else {
                addressed.join(", ")
            }
        );
    }
    Ok(GlooDevice::Interfaces(names))
}

/// The interfaces with an IPv4 or IPv6 address, sorted.
fn addressed_interfaces() -> Vec<String> {
    let mut names = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list that freeifaddrs releases; it is only read in between.
    unsafe {
        if libc::getifaddrs(&mut head) != 0 {
            return names;
        }
        let mut p = head;
        while !p.is_null() {
            let a = &*p;
            let family = if a.ifa_addr.is_null() {
                -1
            } else {
                i32::from((*a.ifa_addr).sa_family)
            };
            if family == libc::AF_INET || family == libc::AF_INET6 {
                let name = std::ffi::CStr::from_ptr(a.ifa_name).to_string_lossy().into_owned();
                if !names.contains(&name) {
                    names.push(name);
                }
            }
            p = a.ifa_next;
        }
        libc::freeifaddrs(head);
    }
    names.sort();
    names
}

/// The interfaces the kernel lists, sorted.
fn existing_interfaces() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/net")
        .map(|d| d.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

/// The local address the kernel would send from to reach `master` (a UDP "connection" sends
/// nothing; it only picks the route).
fn route_to(master: &str, port: u16) -> Result<IpAddr> {
    let addrs: Vec<SocketAddr> = (master, port)
        .to_socket_addrs()
        .with_context(|| format!("MASTER_ADDR={master:?} does not resolve to an address"))?
        .collect();
    let mut last = None;
    for a in &addrs {
        let any: IpAddr = if a.is_ipv4() {
            Ipv4Addr::UNSPECIFIED.into()
        } else {
            Ipv6Addr::UNSPECIFIED.into()
        };
        let found = UdpSocket::bind((any, 0))
            .and_then(|s| s.connect(a).and_then(|()| s.local_addr()))
            .map(|l| l.ip());
        match found {
            Ok(ip) if !ip.is_unspecified() => return Ok(ip),
            Ok(ip) => last = Some(format!("the route to {a} leaves from {ip}")),
            Err(e) => last = Some(format!("{a}: {e}")),
        }
    }
    bail!(
        "no local address reaches MASTER_ADDR={master:?} ({}); set {IFNAME} to the network interface the \
         other nodes reach this machine on",
        last.unwrap_or_else(|| "it resolves to no address".to_owned())
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_route_to_a_local_master_leaves_from_loopback() {
        let d = gloo_device(None, "127.0.0.1", 29500).unwrap();
        assert_eq!(d, GlooDevice::Address(Ipv4Addr::LOCALHOST.into()));
        let GlooDevice::Address(ip) = gloo_device(None, "localhost", 29500).unwrap() else {
            panic!("an address")
        };
        assert!(ip.is_loopback(), "{ip}");
        // An empty variable is no choice.
        assert!(matches!(
            gloo_device(Some(" "), "127.0.0.1", 1).unwrap(),
            GlooDevice::Address(_)
        ));
    }

    #[test]
    fn named_interfaces_must_exist() {
        let have = vec!["eth0".to_owned(), "ifb0".to_owned(), "lo".to_owned()];
        let addressed = vec!["eth0".to_owned(), "lo".to_owned()];
        assert_eq!(
            interfaces_with("eth0, lo", &have, &addressed).unwrap(),
            GlooDevice::Interfaces(vec!["eth0".into(), "lo".into()])
        );
        let e = interfaces_with("ifb0", &have, &addressed).unwrap_err().to_string();
        assert!(e.contains("\"ifb0\" has no IP address"), "{e}");
        assert!(e.contains("with an address here: eth0, lo"), "{e}");
        assert!(addressed_interfaces().contains(&"lo".to_owned()));
        let have = vec!["eth0".to_owned(), "lo".to_owned()];
        let e = interfaces_with("eth0,ib0", &have, &addressed).unwrap_err().to_string();
        assert!(e.contains("no network interface \"ib0\" (it has: eth0, lo)"), "{e}");
        assert!(e.contains("GLOO_SOCKET_IFNAME=\"eth0,ib0\""), "{e}");
        assert!(existing_interfaces().contains(&"lo".to_owned()));
    }

    #[test]
    fn an_unresolvable_master_is_named() {
        let e = route_to("no-such-host.invalid", 29500).unwrap_err().to_string();
        assert!(
            e.contains("MASTER_ADDR=\"no-such-host.invalid\" does not resolve"),
            "{e}"
        );
    }
}
