"""Kubernetes API clients built the Chaos Toolkit way, and a credential-free description of them.

This module owns where the credentials come from, in this order:

1. the experiment's secrets naming an API server (`KUBERNETES_HOST` with `KUBERNETES_API_KEY`
   [+ `KUBERNETES_API_KEY_PREFIX`], `KUBERNETES_CERT_FILE`/`KUBERNETES_KEY_FILE`, or
   `KUBERNETES_USERNAME`/`KUBERNETES_PASSWORD`; `KUBERNETES_VERIFY_SSL`,
   `KUBERNETES_CA_CERT_FILE`): explicit secrets win over any ambient configuration;
2. the kubeconfig named by `$KUBECONFIG` (read now) or `~/.kube/config`, context from
   `KUBERNETES_CONTEXT`, loaded into a private configuration (chaosk8s checks `$KUBECONFIG` but
   then loads the kubernetes client's default path, computed when `kubernetes` was imported, and
   overwrites the process-wide default configuration);
3. otherwise chaostoolkit-kubernetes's own factory (`chaosk8s.create_k8s_api_client`):
   in-cluster when `CHAOSTOOLKIT_IN_POD=true`, or the `KUBERNETES_*` keys from the environment;
4. in-cluster service-account credentials when running in a pod (`KUBERNETES_SERVICE_HOST`) even
   without `CHAOSTOOLKIT_IN_POD`.

With none of these it refuses with a clear error instead of chaosk8s's silent
`http://localhost`. It must never put a credential into a return value, a log line or a journal:
`describe()` gives the host and the kind of authentication only.
"""

import logging
import os
from typing import Any

from kubernetes import client, config

__all__ = ["NoCredentialsError", "api_client", "core_api", "describe"]

logger = logging.getLogger("chaostoolkit")

_HOST_KEYS = ("KUBERNETES_HOST",)


class NoCredentialsError(RuntimeError):
    """No Kubernetes credentials could be found in secrets, environment, kubeconfig or pod."""


def _lookup(secrets: dict[str, Any], key: str, default: Any = None) -> Any:
    if key in secrets:
        return secrets[key]
    return os.environ.get(key, default)


def _truthy(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _from_secrets(secrets: dict[str, Any]) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = str(secrets["KUBERNETES_HOST"]).rstrip("/")
    verify = _lookup(secrets, "KUBERNETES_VERIFY_SSL")
    configuration.verify_ssl = _truthy(verify) if verify is not None else True
    ca_file = _lookup(secrets, "KUBERNETES_CA_CERT_FILE")
    if ca_file:
        configuration.ssl_ca_cert = ca_file
    if "KUBERNETES_API_KEY" in secrets:
        configuration.api_key["authorization"] = secrets["KUBERNETES_API_KEY"]
        configuration.api_key_prefix["authorization"] = secrets.get(
            "KUBERNETES_API_KEY_PREFIX", "Bearer")
    elif "KUBERNETES_CERT_FILE" in secrets:
        configuration.cert_file = secrets["KUBERNETES_CERT_FILE"]
        configuration.key_file = secrets.get("KUBERNETES_KEY_FILE")
    elif "KUBERNETES_USERNAME" in secrets:
        configuration.username = secrets["KUBERNETES_USERNAME"]
        configuration.password = secrets.get("KUBERNETES_PASSWORD", "")
    return client.ApiClient(configuration)


def _kubeconfig_path() -> str:
    return os.path.expanduser(os.environ.get("KUBECONFIG", "~/.kube/config"))


def api_client(secrets: dict[str, Any] | None = None) -> client.ApiClient:
    """Return a `kubernetes.client.ApiClient` from secrets, environment, kubeconfig or pod."""
    secrets = dict(secrets or {})
    if any(secrets.get(key) for key in _HOST_KEYS):
        logger.debug("Kubernetes API from the experiment's secrets")
        return _from_secrets(secrets)
    kubeconfig = _kubeconfig_path()
    if os.path.exists(kubeconfig):
        configuration = client.Configuration()
        config.load_kube_config(config_file=kubeconfig,
                                context=_lookup(secrets, "KUBERNETES_CONTEXT"),
                                client_configuration=configuration, persist_config=False)
        logger.debug("Kubernetes API from kubeconfig %s", kubeconfig)
        return client.ApiClient(configuration)
    if os.environ.get("CHAOSTOOLKIT_IN_POD") == "true" or os.environ.get("KUBERNETES_HOST"):
        from chaosk8s import create_k8s_api_client

        logger.debug("Kubernetes API through chaostoolkit-kubernetes's client factory")
        return create_k8s_api_client(secrets)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        logger.debug("Kubernetes API from in-cluster service account")
        return client.ApiClient(configuration)
    raise NoCredentialsError(
        "no Kubernetes credentials: set KUBERNETES_HOST (+ KUBERNETES_API_KEY ...) in the "
        "experiment's secrets or environment, provide a kubeconfig ($KUBECONFIG or "
        f"~/.kube/config; {_kubeconfig_path()} does not exist), or run in a pod")


def core_api(secrets: dict[str, Any] | None = None) -> client.CoreV1Api:
    """Return a CoreV1Api on the client `api_client(secrets)` builds."""
    return client.CoreV1Api(api_client(secrets))


def describe(api: client.ApiClient) -> dict[str, Any]:
    """Describe an API client without any credential: host, TLS verification, auth kind."""
    configuration = api.configuration
    if configuration.api_key.get("authorization") or configuration.api_key.get("BearerToken"):
        auth = "token"
    elif configuration.cert_file:
        auth = "client-certificate"
    elif configuration.username:
        auth = "basic"
    else:
        auth = "none"
    return {"host": configuration.host, "verify_ssl": bool(configuration.verify_ssl),
            "auth": auth}
