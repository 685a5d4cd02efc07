"""Fast byte-range reads of ``s3://`` stores through obstore (Rust), when it is installed.

Everything else about a remote store (metadata, writes, locks, deletion) goes through zarr's
``FsspecStore`` (s3fs). For the bulk reads of a score pass s3fs's asyncio HTTP client is the
bottleneck: on the local S3 server, 8 concurrent 4 MiB ranged reads took 0.088 s through it
against 0.057 s for boto3's plain GETs and 0.044 s through zarr's ``ObjectStore`` over obstore
(``benchmarks/scale_out.py``). So raw row reads use the latter, with the same credentials,
region and endpoint s3fs would use (botocore resolves them: environment, ``~/.aws``, instance
roles). Without obstore (``pip install 'tracinfunc[s3]'`` brings it) reads use s3fs.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta

__all__ = ["object_store_for_reads"]

_CREDENTIAL_TTL = timedelta(minutes=15)  # re-asked of botocore (which refreshes) after this


def object_store_for_reads(url: str):
    """A read-only zarr ``ObjectStore`` rooted at ``url``, or ``None`` (use zarr's own store).

    ``None`` for schemes other than ``s3://``, without obstore or botocore, and when botocore
    finds no credentials (anonymous access stays with s3fs)."""
    from zarr.storage import ObjectStore
    if not url.startswith("s3://"):
        return None
    try:
        import botocore.session
        from obstore.store import S3Store
    except ImportError:
        return None
    session = botocore.session.get_session()
    credentials = session.get_credentials()
    if credentials is None:
        return None
    config = {}
    region = session.get_config_variable("region")
    if region:
        config["region"] = region
    endpoint = (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                or _configured_endpoint(session))
    if endpoint:
        config["endpoint"] = endpoint

    def provide():
        frozen = credentials.get_frozen_credentials()
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                "token": frozen.token, "expires_at": datetime.now(UTC) + _CREDENTIAL_TTL}

    store = S3Store.from_url(
        url, config=config, credential_provider=provide,
        client_options={"allow_http": bool(endpoint and endpoint.startswith("http://"))},
    )
    return ObjectStore(store, read_only=True)


def _configured_endpoint(session) -> str | None:
    try:
        return session.get_config_variable("endpoint_url")
    except Exception:  # older botocore: no such variable
        return None
