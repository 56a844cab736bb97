"""The URL of a worker added at run time (the admin API): what the router will send prompts,
its workers' keys and health checks to, so held to a strict form (docs/router.md, "Admin API").

A worker URL is ``http`` or ``https``, a host and an optional port, nothing else: no user or
password (the router sends the workers' key itself, ``router.auth.worker_api_key_env``), no
path, query or fragment. With ``router.admin.worker_networks`` set, its host must be an address
in one of those networks, or a name that resolves only into them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from urllib.parse import urlsplit

#: a DNS host name (RFC 1123 labels)
_HOST_NAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)
_RESOLVE_TIMEOUT_S = 2.0

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class BadWorkerUrl(ValueError):
    """A worker URL the router refuses; the message names the problem."""


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def worker_url(url: object) -> str:
    """``url`` as the router stores it (``scheme://host[:port]``), or :class:`BadWorkerUrl`."""
    if not isinstance(url, str) or not url:
        raise BadWorkerUrl("'url' must be an http(s) URL such as http://10.0.0.5:30000")
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        raise BadWorkerUrl("'url' has whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise BadWorkerUrl(f"'url' is not a URL: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise BadWorkerUrl(f"'url' scheme must be http or https, not {parts.scheme[:20]!r}")
    if parts.username is not None or parts.password is not None:
        raise BadWorkerUrl(
            "'url' must not carry a user or password: the router sends the workers' key itself "
            "(router.auth.worker_api_key_env)"
        )
    if parts.path not in ("", "/"):
        raise BadWorkerUrl("'url' must have no path: a worker serves at its root")
    if parts.query or "?" in url:
        raise BadWorkerUrl("'url' must have no query")
    if parts.fragment or "#" in url:
        raise BadWorkerUrl("'url' must have no fragment")
    host = parts.hostname
    if not host:
        raise BadWorkerUrl("'url' has no host")
    if _address(host) is None and not _HOST_NAME.fullmatch(host):
        raise BadWorkerUrl(f"'url' host {host[:60]!r} is neither an address nor a host name")
    if port == 0:
        raise BadWorkerUrl("'url' port must be 1 to 65535")
    shown = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{shown}" + (f":{port}" if port is not None else "")


def networks(cidrs: list[str]) -> list[Network]:
    """``router.admin.worker_networks`` parsed (validated when the config was read)."""
    return [ipaddress.ip_network(c, strict=False) for c in cidrs]


async def check_host(host: str, allowed: list[Network]) -> None:
    """:class:`BadWorkerUrl` unless ``host`` is in ``allowed`` (empty: anything is): an
    address in one of the networks, or a name whose every address is."""
    if not allowed:
        return
    addr = _address(host.strip("[]"))
    if addr is not None:
        found = [addr]
    else:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, None, type=socket.SOCK_STREAM), _RESOLVE_TIMEOUT_S
            )
        except (OSError, asyncio.TimeoutError) as e:
            raise BadWorkerUrl(f"'url' host {host[:60]!r} does not resolve: {e}") from None
        found = [ipaddress.ip_address(i[4][0].split("%", 1)[0]) for i in infos]
    outside = [a for a in found if not any(a in net for net in allowed)]
    if outside or not found:
        nets = ", ".join(str(n) for n in allowed)
        raise BadWorkerUrl(
            f"'url' host {host[:60]!r} ({outside[0] if outside else 'no address'}) is outside "
            f"router.admin.worker_networks ({nets})"
        )
