"""Which network interface the workers' gloo traffic uses (GLOO_SOCKET_IFNAME), checked at start.

gloo advertises the address of the interface named by ``GLOO_SOCKET_IFNAME``, else the address its host
name resolves to -- on many hosts 127.0.1.1 or 127.0.0.1, which peers on other hosts cannot reach: the
job then fails in its first collective, or hangs in it. So, before any worker starts, each agent:

* with ``GLOO_SOCKET_IFNAME`` set: checks that every interface it names exists here and has an IPv4
  address (else fails at start naming the interfaces this host has);
* else, with ``--local-addr``: uses the interface that holds that address (fails if none does);
* else, for a job whose workers talk to other hosts (``--nnodes`` > 1 and a non-loopback master
  address): picks the interface through which this host routes to the master address -- the one a
  peer on the master's network reaches it by -- and sets GLOO_SOCKET_IFNAME for its workers;
* a single-node job, or one whose nodes all run on loopback, needs nothing.

Linux only (SIOCGIFADDR); elsewhere the check is skipped and gloo's own choice applies.

``flap_advice`` says, for a multi-host job, whether the chosen interface drops its ARP entries when its
carrier goes (``net.ipv4.conf.<if>.arp_evict_nocarrier``, 1 by default since Linux 5.16): a link flap
of a few hundred ms then stops traffic to the peers for 1-2 s (docs/recovery.md, "Outage tolerance").
"""
from __future__ import annotations

import ipaddress
import socket
import struct

from ..errors import ConfigError

__all__ = ["interfaces", "route_source", "choose", "flap_advice"]

_SIOCGIFADDR = 0x8915


def interfaces() -> dict[str, str]:
    """{interface name: its IPv4 address} of this host (interfaces without one are left out)."""
    import fcntl

    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _idx, name in socket.if_nameindex():
            try:
                res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            out[name] = socket.inet_ntoa(res[20:24])
    return out


def route_source(host: str, port: int = 9) -> str:
    """The local address this host uses to reach ``host`` (a UDP connect sends nothing)."""
    try:
        addr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    except socket.gaierror as exc:
        raise ConfigError(f"--master-addr {host!r} does not resolve to an IPv4 address ({exc}); "
                          f"give node 0's IP address") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, port))
        except OSError as exc:
            raise ConfigError(f"no route from this host to the master address {host} ({addr}): {exc}; "
                              f"check --master-addr, or name the interface with GLOO_SOCKET_IFNAME") from None
        return s.getsockname()[0]


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def choose(env: dict, master_addr: str, local_addr: str | None, multi_node: bool) -> dict:
    """The environment to add for the workers ({} or {"GLOO_SOCKET_IFNAME": name}); raises ConfigError
    with what to do when no usable interface exists. ``env``: the workers' environment so far."""
    try:
        have = interfaces()
    except (ImportError, OSError):  # not Linux: leave the choice to gloo
        return {}
    named = env.get("GLOO_SOCKET_IFNAME")
    if named:
        missing = [n for n in named.split(",") if n.strip() not in have]
        if missing:
            raise ConfigError(f"GLOO_SOCKET_IFNAME={named}: no interface {', '.join(missing)} with an IPv4 "
                              f"address on this host; it has {_listing(have)}")
        return {}
    if local_addr:
        try:
            want = socket.gethostbyname(local_addr)
        except OSError as exc:
            raise ConfigError(f"--local-addr {local_addr!r} does not resolve ({exc})") from None
        name = next((n for n, a in have.items() if a == want), None)
        if name is None:
            raise ConfigError(f"--local-addr {local_addr} ({want}) is not an address of this host; "
                              f"it has {_listing(have)}")
        return {"GLOO_SOCKET_IFNAME": name}
    if not multi_node or _loopback(master_addr):
        return {}
    src = route_source(master_addr)
    name = next((n for n, a in have.items() if a == src), None)
    if name is None:
        raise ConfigError(f"this host reaches the master address {master_addr} from {src}, which no interface "
                          f"holds ({_listing(have)}); set GLOO_SOCKET_IFNAME or --local-addr")
    return {"GLOO_SOCKET_IFNAME": name}


def _listing(have: dict) -> str:
    return ", ".join(f"{n} ({a})" for n, a in sorted(have.items())) or "no IPv4 interface"


def flap_advice(ifnames: str, proc: str = "/proc/sys/net/ipv4/conf") -> str | None:
    """A line for the operator when an interface of ``ifnames`` (GLOO_SOCKET_IFNAME's form) evicts its ARP
    entries on carrier loss; None when none does, or the kernel has no such setting."""
    evicting = []
    for name in (n.strip() for n in ifnames.split(",") if n.strip()):
        try:
            with open(f"{proc}/{name}/arp_evict_nocarrier") as f:
                if f.read().strip() != "0":
                    evicting.append(name)
        except OSError:  # an older kernel (< 5.16): it keeps them
            continue
    if not evicting:
        return None
    sysctl = " ".join(f"net.ipv4.conf.{n}.arp_evict_nocarrier=0" for n in evicting)
    return (f"interface(s) {', '.join(evicting)} drop their ARP entries when the link's carrier goes "
            f"(arp_evict_nocarrier=1): a link flap of a few hundred ms then stops this host's traffic for "
            f"1-2 s, and flaps that add up past the liveness bound are taken for a lost node; where links "
            f"may flap, set `sysctl -w {sysctl}` (docs/recovery.md, Outage tolerance)")
