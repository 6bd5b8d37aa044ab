"""Which client serves a URL: obstore (Rust ``object_store``) for s3://, gs:// and az:// where it
is installed, fsspec's own filesystems (s3fs, gcsfs, adlfs, ...) for the rest.

Why: every GET through s3fs costs ~3.5 ms of Python CPU (botocore builds, signs and parses each
request in Python) on the loader's one event loop, which caps a process near 300 objects/s;
obstore does the same work in Rust for ~0.4 ms. Users keep writing the fsspec-style
``storage_options`` they know (``endpoint_url``, ``key``, ``secret``, ``anon``, ``profile``, GCS
``token``, ...): they are translated here, obstore's own names (``config``, ``client_options``,
``aws_endpoint``, ``region``, ...) are accepted as well, and an option obstore cannot serve
(``use_ssl``, ``s3_additional_kwargs``, gcsfs's ``token="cache"``, ...) sends that protocol back
to fsspec. ``storage_options={"client": "fsspec"}`` (or ``"obstore"``) chooses the client
explicitly; ``"auto"`` is the default.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
from datetime import timedelta
from typing import Any

import fsspec
from fsspec.core import split_protocol

# fsspec protocol -> obstore's scheme for it.
OBSTORE_SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "az": "az", "abfs": "az", "abfss": "az"}
CLIENTS = ("auto", "obstore", "fsspec")
OBSTORE_OWN = ("config", "client_options", "retry_config", "credential_provider")
FSSPEC_PLUMBING = ("skip_instance_cache", "asynchronous", "loop", "use_listings_cache", "listings_expiry_time",
                   "max_paths", "default_block_size", "default_fill_cache", "default_cache_type", "cache_regions")
FSSPEC_CLASSES = {"s3": "s3fs.S3FileSystem", "gs": "gcsfs.GCSFileSystem", "az": "adlfs.AzureBlobFileSystem"}


class Unsupported(Exception):
    """An option obstore cannot serve (the protocol then goes to fsspec's filesystem)."""


def client_for(protocol: str, storage_options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """``("obstore", FsspecStore keyword arguments)`` or ``("fsspec", that filesystem's options)``
    for ``protocol``. Raises ValueError naming an option neither client knows, or one that the
    explicitly chosen client cannot serve."""
    options = dict(storage_options or {})
    choice = options.pop("client", "auto")
    if choice not in CLIENTS:
        raise ValueError(f"storage_options['client'] must be one of {', '.join(map(repr, CLIENTS))}, got {choice!r}")
    scheme = OBSTORE_SCHEMES.get(protocol)
    if choice == "fsspec" or scheme is None or (choice == "auto" and not has_obstore()):
        return "fsspec", options  # local files, memory, http... stay fsspec's whatever the choice
    if not has_obstore():
        raise ValueError("storage_options['client'] is 'obstore', which is not installed (pip install obstore; Python >= 3.11)")
    try:
        return "obstore", obstore_settings(scheme, options)
    except Unsupported as error:
        if choice == "obstore":
            raise ValueError(f"storage_options: obstore cannot serve {error}; use client='fsspec'") from None
        return "fsspec", options


@functools.cache
def has_obstore() -> bool:
    try:
        import obstore.fsspec  # noqa: F401
    except ImportError:
        return False
    return True


def obstore_settings(scheme: str, options: dict[str, Any]) -> dict[str, Any]:
    """fsspec-style ``options`` as keyword arguments of obstore's ``from_url`` for ``scheme``,
    checked by building a store (no request is sent)."""
    options = {k: v for k, v in options.items() if k not in FSSPEC_PLUMBING}
    settings: dict[str, Any] = {name: options.pop(name) for name in OBSTORE_OWN if options.get(name) is not None}
    config = dict(settings.get("config") or {})
    client_options = dict(settings.get("client_options") or {})
    {"s3": _s3, "gs": _gcs, "az": _azure}[scheme](options, config, client_options, settings)
    config.update(options)  # what is left: obstore's own flat names (aws_endpoint, region, ...)
    settings.update(config=config, client_options=client_options)
    _check(scheme, settings, set(options))
    return settings


def _s3(options: dict[str, Any], config: dict[str, Any], client_options: dict[str, Any], settings: dict[str, Any]) -> None:
    """s3fs's names: endpoint_url, key/secret/token (username/password), anon, requester_pays,
    client_kwargs (endpoint_url, region_name, verify), config_kwargs (pool, retries, timeouts,
    addressing style); and ``region`` and ``profile``."""
    client_kwargs = dict(options.pop("client_kwargs", None) or {})
    endpoint = options.pop("endpoint_url", None) or client_kwargs.pop("endpoint_url", None)
    if endpoint:
        config["endpoint"] = endpoint
        if endpoint.startswith("http://"):
            client_options.setdefault("allow_http", True)
    for ours, theirs in (("key", "access_key_id"), ("username", "access_key_id"), ("secret", "secret_access_key"),
                         ("password", "secret_access_key"), ("token", "token")):
        if options.get(ours) is not None:
            config[theirs] = options.pop(ours)
        options.pop(ours, None)
    if options.pop("anon", False):
        config["skip_signature"] = True
    if options.pop("requester_pays", False):
        config["request_payer"] = True
    region = client_kwargs.pop("region_name", None)
    if region:
        config.setdefault("region", region)
    if client_kwargs.pop("verify", True) is False:
        client_options["allow_invalid_certificates"] = True
    if client_kwargs:
        raise Unsupported(f"client_kwargs {sorted(client_kwargs)}")
    _s3_config_kwargs(dict(options.pop("config_kwargs", None) or {}), config, client_options)
    if options.get("use_ssl") is True:
        options.pop("use_ssl")
    profile = options.pop("profile", None)
    if "credential_provider" not in settings:
        provider = _boto3_provider(profile, config)
        if provider is not None:
            settings["credential_provider"] = provider


def _s3_config_kwargs(config_kwargs: dict[str, Any], config: dict[str, Any], client_options: dict[str, Any]) -> None:
    """botocore's Config: its pool and retries are moot (obstore has no connection cap, retries
    are ours), its timeouts become the client's, path/virtual addressing the store's."""
    config_kwargs.pop("max_pool_connections", None)
    config_kwargs.pop("retries", None)
    config_kwargs.pop("read_timeout", None)  # the reader's read_timeout bounds every read
    if "connect_timeout" in config_kwargs:
        client_options["connect_timeout"] = timedelta(seconds=float(config_kwargs.pop("connect_timeout")))
    style = (config_kwargs.pop("s3", None) or {}).get("addressing_style")
    if style in ("path", "virtual"):
        config["virtual_hosted_style_request"] = style == "virtual"
    if config_kwargs:
        raise Unsupported(f"config_kwargs {sorted(config_kwargs)}")


def _boto3_provider(profile: str | None, config: dict[str, Any]) -> Any:
    """Credentials where botocore finds them (``~/.aws`` profiles, SSO, ...) when the options do
    not give them: object_store reads the environment, web identity and instance metadata, not
    ``~/.aws``. Only when a profile is named or ``~/.aws`` exists, so a machine without one
    neither needs boto3 nor pays for its chain."""
    explicit = any(k in config for k in ("access_key_id", "aws_access_key_id", "skip_signature", "aws_skip_signature"))
    aws_files = os.path.exists(os.path.expanduser(os.environ.get("AWS_CONFIG_FILE", "~/.aws/config"))) or \
        os.path.exists(os.path.expanduser(os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")))
    if explicit or (profile is None and (not aws_files or "AWS_ACCESS_KEY_ID" in os.environ)):
        return None
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        if profile is not None:
            raise Unsupported("profile (it needs boto3)") from None
        return None
    try:
        return Boto3CredentialProvider(boto3.Session(profile_name=profile))
    except ValueError:  # botocore found no credentials: object_store's own chain may
        if profile is not None:
            raise
        return None


def _gcs(options: dict[str, Any], config: dict[str, Any], client_options: dict[str, Any], settings: dict[str, Any]) -> None:
    """gcsfs's names: ``token`` ("anon", "google_default", None, a credentials file, a service
    account dict), ``project`` (not needed to read objects), ``endpoint_url``."""
    token = options.pop("token", None)
    options.pop("project", None)
    if token == "anon":
        config["skip_signature"] = True
    elif isinstance(token, dict) and token.get("type") == "service_account":
        config["service_account_key"] = json.dumps(token)
    elif isinstance(token, (str, os.PathLike)) and os.path.isfile(token):
        config["application_credentials"] = os.fspath(token)
    elif token not in (None, "google_default"):
        raise Unsupported(f"token={token!r}" if isinstance(token, str) else "token (this kind)")
    endpoint = options.pop("endpoint_url", None)
    if endpoint:
        config["base_url"] = endpoint
        if endpoint.startswith("http://"):
            client_options.setdefault("allow_http", True)


def _azure(options: dict[str, Any], config: dict[str, Any], client_options: dict[str, Any], settings: dict[str, Any]) -> None:
    """adlfs's names: account_name, account_key, sas_token, tenant_id/client_id/client_secret, anon."""
    for ours, theirs in (("account_name", "account_name"), ("account_key", "account_key"), ("sas_token", "sas_token"),
                         ("tenant_id", "tenant_id"), ("client_id", "client_id"), ("client_secret", "client_secret")):
        if options.get(ours) is not None:
            config[theirs] = options.pop(ours)
    if options.pop("anon", False):
        config["skip_signature"] = True


def _check(scheme: str, settings: dict[str, Any], flat: set[str]) -> None:
    """Builds a store from ``settings``: an unknown key is named; one that fsspec's filesystem
    for the scheme takes is Unsupported (served there)."""
    from obstore.store import from_url

    try:
        from_url(f"{scheme}://asyncload-check", **settings)
    except Exception as error:
        if type(error).__name__ != "UnknownConfigurationKeyError" and not re.match("Invalid key", str(error)):
            raise
        match = re.search(r"(?:Configuration key: '|Invalid key: )([^'.\s]+)", str(error))
        key = match.group(1) if match else "?"
        if key in flat and key in _fsspec_parameters(scheme):
            raise Unsupported(repr(key)) from None
        where = repr(key) if key in flat else f"client_options[{key!r}]" if str(error).startswith("Invalid key") else f"config[{key!r}]"
        raise ValueError(f"storage option {where} is not valid for {scheme}:// (neither an fsspec-style option "
                         f"asyncload translates nor one of obstore's): {str(error).splitlines()[0]}") from None


def _fsspec_parameters(scheme: str) -> set[str]:
    """The keyword arguments fsspec's filesystem for ``scheme`` takes (none if not installed)."""
    module, _, name = FSSPEC_CLASSES[scheme].rpartition(".")
    try:
        cls = getattr(__import__(module), name)
    except (ImportError, AttributeError):
        return set()
    return set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs", "args"}


@functools.cache
def _store_class(protocol: str) -> type:
    """obstore's fsspec filesystem with ``protocol`` as its class's own (as ``obstore.fsspec.register``
    makes them, without touching fsspec's registry), so paths strip and unstrip as fsspec's do;
    for S3 it finds a bucket's region when nothing says it (see ``_bucket_region``)."""
    from obstore.fsspec import FsspecStore
    from obstore.store import from_url

    def construct_store(self: Any, bucket: str) -> Any:
        config = self._config or {}
        if OBSTORE_SCHEMES[protocol] == "s3" and not _region_known(config, self._credential_provider):
            region = _bucket_region(bucket)
            if region is not None:
                config = {**config, "region": region}
        return from_url(f"{protocol}://{bucket}", config=config, client_options=self._client_options,
                        retry_config=self._retry_config, credential_provider=self._credential_provider,
                        **self._config_kwargs)

    return type(f"FsspecStore_{protocol}", (FsspecStore,), {"protocol": protocol, "_construct_store": construct_store})


# Where S3 says which region a bucket is in (the x-amz-bucket-region header of any answer,
# even a redirect or a denial), for buckets whose region nothing configures: s3fs finds it
# by itself, object_store assumes us-east-1.
AWS_BUCKET_REGION_URL = "https://s3.amazonaws.com/{bucket}"
REGION_KEYS = {"region", "aws_region", "default_region", "aws_default_region", "endpoint", "aws_endpoint",
               "aws_endpoint_url", "endpoint_url"}


def _region_known(config: dict[str, Any], provider: Any) -> bool:
    """Whether a region (or an endpoint other than AWS's) is set in the options, the environment
    or the credential provider."""
    keys = {k.lower() for k in config} | {k.lower() for k in getattr(provider, "config", None) or {}}
    env = {"AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT", "AWS_ENDPOINT_URL"} & set(os.environ)
    return bool(keys & REGION_KEYS or env)


@functools.lru_cache(maxsize=256)
def _bucket_region(bucket: str, timeout: float = 5.0) -> str | None:
    """The region S3 names for ``bucket`` in one unsigned HEAD; None if it names none."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(AWS_BUCKET_REGION_URL.format(bucket=bucket), method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.headers.get("x-amz-bucket-region")
    except urllib.error.HTTPError as answer:  # 301, 403: still an answer with the header
        return answer.headers.get("x-amz-bucket-region")
    except OSError:
        return None


def filesystem(protocol: str, storage_options: dict[str, Any] | None, *, loop: Any = None,
               read_timeout: float | None = None, connections: int = 64) -> Any:
    """A fresh filesystem for ``protocol`` from the client ``client_for`` picks; asynchronous
    (fsspec's) when ``loop`` is given. With ``read_timeout`` it is tuned for the reader, whose
    retries and timeout must be the only ones: the client retries nothing itself, its own
    timeout lies beyond ours, and it may hold ``connections`` connections."""
    client, options = client_for(protocol, storage_options)
    asynchronous = {"asynchronous": True} if loop is not None else {}
    if client == "obstore":  # obstore runs its own runtime: FsspecStore takes no loop
        if read_timeout is not None:
            _obstore_for_reads(options, read_timeout)
        return _store_class(protocol)(skip_instance_cache=True, **options, **asynchronous)
    cls = fsspec.get_filesystem_class(protocol)
    if cls.async_impl and loop is not None:
        asynchronous["loop"] = loop
    is_s3fs = "config_kwargs" in inspect.signature(cls.__init__).parameters
    if is_s3fs and read_timeout is not None:
        _s3fs_for_reads(options, connections)
    fs = cls(skip_instance_cache=True, **options, **asynchronous)
    if is_s3fs and read_timeout is not None and "retries" not in options:
        fs.retries = 1  # s3fs's own retry loop: one attempt, then ours
    return fs


def _s3fs_for_reads(options: dict[str, Any], connections: int) -> None:
    """botocore allows 10 connections by default, which would cap reads in flight, and retries
    by itself, unseen and unbounded by ours."""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("max_pool_connections", connections)
    config.setdefault("retries", {"total_max_attempts": 1})
    options["config_kwargs"] = config


def _obstore_for_reads(options: dict[str, Any], read_timeout: float) -> None:
    """obstore retries 10 times by itself and ends every request at 30 s: leave retrying to the
    reader and let its timeout be the one that fires (a user's own settings win). Its HTTP
    client has no cap on connections."""
    options["retry_config"] = options.get("retry_config") or {"max_retries": 0}
    options["client_options"] = {"timeout": timedelta(seconds=read_timeout + 1), **(options.get("client_options") or {})}


def url_to_fs(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """``fsspec.core.url_to_fs`` through ``filesystem``: the filesystem and the path in it."""
    protocol = split_protocol(url)[0] or "file"
    if protocol not in OBSTORE_SCHEMES:
        return fsspec.core.url_to_fs(url, **{k: v for k, v in (storage_options or {}).items() if k != "client"})
    fs = filesystem(protocol, storage_options)
    return fs, fs._strip_protocol(url)


def release(fs: Any) -> None:
    """Closes the connections an obstore filesystem keeps: it holds a store, with its pool, per
    bucket in an lru_cache on the instance (a reference cycle, so dropping the instance would
    free them only at a GC). Other filesystems are left as they are."""
    if is_obstore(fs):
        fs._construct_store.cache_clear()


def is_obstore(fs: Any) -> bool:
    return has_obstore() and isinstance(fs, __import__("obstore.fsspec").fsspec.FsspecStore)
