"""fsspec-style ``storage_options`` as obstore's store settings (see ``object_store`` for why).

S3 takes s3fs's names, GCS gcsfs's, Azure adlfs's; obstore's own names pass through. An option
fsspec's filesystem takes but obstore cannot serve raises ``Unsupported`` (the caller then
uses fsspec's filesystem); one neither knows raises ValueError naming it. The result is checked
by building a store, which sends no request.
"""

from __future__ import annotations

import inspect
import json
import os
import re
from datetime import timedelta
from typing import Any

OBSTORE_OWN = ("config", "client_options", "retry_config", "credential_provider")
FSSPEC_PLUMBING = ("skip_instance_cache", "asynchronous", "loop", "use_listings_cache", "listings_expiry_time",
                   "max_paths", "default_block_size", "default_fill_cache", "default_cache_type", "cache_regions")
FSSPEC_CLASSES = {"s3": "s3fs.S3FileSystem", "gs": "gcsfs.GCSFileSystem", "az": "adlfs.AzureBlobFileSystem"}


class Unsupported(Exception):
    """An option obstore cannot serve (the protocol then goes to fsspec's filesystem)."""


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
    endpoint = options.pop("endpoint_url", None) or client_kwargs.get("endpoint_url")
    client_kwargs.pop("endpoint_url", None)
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
    verify = client_kwargs.pop("verify", None)
    if verify is False:
        client_options["allow_invalid_certificates"] = True
    elif verify not in (None, True):  # a CA bundle
        raise Unsupported("client_kwargs verify=<CA bundle>")
    if client_kwargs:
        raise Unsupported(f"client_kwargs {sorted(client_kwargs)}")
    _s3_config_kwargs(dict(options.pop("config_kwargs", None) or {}), config, client_options)
    if options.get("use_ssl") is True:
        options.pop("use_ssl")
    profile = options.pop("profile", None)
    if "credential_provider" not in settings:
        provider = _boto3_provider(profile, {**config, **options})
        if provider is not None:
            settings["credential_provider"] = provider


def _s3_config_kwargs(config_kwargs: dict[str, Any], config: dict[str, Any], client_options: dict[str, Any]) -> None:
    """botocore's Config: its pool and retries are moot (obstore has no connection cap, retries
    are asyncload's: see ``named_retries``), its timeouts become the client's (obstore's own
    ``client_options`` win), path/virtual addressing the store's."""
    config_kwargs.pop("max_pool_connections", None)
    config_kwargs.pop("retries", None)
    for theirs, ours in (("read_timeout", "timeout"), ("connect_timeout", "connect_timeout")):
        if theirs in config_kwargs:
            client_options.setdefault(ours, timedelta(seconds=float(config_kwargs.pop(theirs))))
    style = (config_kwargs.pop("s3", None) or {}).get("addressing_style")
    if style in ("path", "virtual"):
        config["virtual_hosted_style_request"] = style == "virtual"
    if config_kwargs:
        raise Unsupported(f"config_kwargs {sorted(config_kwargs)}")


def named_retries(storage_options: dict[str, Any] | None) -> int | None:
    """The retries after a failed request that ``storage_options`` name, if any: botocore's
    ``config_kwargs={"retries": {"max_attempts": N}}`` (retries; ``total_max_attempts``
    counts the first request too) or obstore's ``retry_config={"max_retries": N}``."""
    options = storage_options or {}
    botocore = (options.get("config_kwargs") or {}).get("retries") or {}
    if "max_attempts" in botocore:
        return int(botocore["max_attempts"])
    if "total_max_attempts" in botocore:
        return max(0, int(botocore["total_max_attempts"]) - 1)
    obstore = options.get("retry_config") or {}
    return int(obstore["max_retries"]) if "max_retries" in obstore else None


def _boto3_provider(profile: str | None, config: dict[str, Any]) -> Any:
    """Credentials where botocore finds them (``~/.aws`` profiles, SSO, ...) when the options do
    not give them: object_store reads the environment, web identity and instance metadata, not
    ``~/.aws``. Only when a profile is named or ``~/.aws`` exists, so a machine without one
    neither needs boto3 nor pays for its chain."""
    given = {key.lower() for key in config}
    explicit = bool(given & {"access_key_id", "aws_access_key_id", "skip_signature", "aws_skip_signature"})
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
        raise Unsupported("token (a string that is neither a file, 'anon' nor 'google_default')"  # never its value
                          if isinstance(token, str) else "token (this kind)")
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
