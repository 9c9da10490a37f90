"""The one Kubernetes API client factory of chaosgpu, and a credential-free description of it.

Every chaosgpu activity, and every experiment of the catalog (none calls chaostoolkit-kubernetes's
own factory, whose order differs), gets its client here. Credentials come from the first of:

1. the experiment's secrets naming an API server (`KUBERNETES_HOST` with `KUBERNETES_API_KEY`
   [+ `KUBERNETES_API_KEY_PREFIX`], `KUBERNETES_CERT_FILE`/`KUBERNETES_KEY_FILE`, or
   `KUBERNETES_USERNAME`/`KUBERNETES_PASSWORD`; `KUBERNETES_VERIFY_SSL`,
   `KUBERNETES_CA_CERT_FILE`);
2. the same keys from the environment (`KUBERNETES_HOST` set): explicit settings of this run
   win over any ambient configuration;
3. in-cluster service-account credentials when `CHAOSTOOLKIT_IN_POD=true`;
4. the kubeconfig named by `$KUBECONFIG` (read now) or `~/.kube/config`, context from
   `KUBERNETES_CONTEXT`, loaded into a private configuration (never the process-wide default);
5. in-cluster credentials when running in a pod (`KUBERNETES_SERVICE_HOST`).

chaostoolkit-kubernetes (`chaosk8s.create_k8s_api_client`) checks in-pod, then the kubeconfig,
then `KUBERNETES_HOST`, and falls back to `http://localhost`: the opposite order for 2 and 4,
so it is not used. With none of these it refuses with a clear error. It must never put a
credential into a return value, a log line or a journal: `describe()` gives the host and the
kind of authentication only.
"""

import logging
import os
from typing import Any

from kubernetes import client, config

__all__ = ["NoCredentialsError", "api_client", "core_api", "credential_source", "describe"]

logger = logging.getLogger("chaostoolkit")

_HOST_KEYS = ("KUBERNETES_HOST",)
_ENV_KEYS = ("KUBERNETES_HOST", "KUBERNETES_API_KEY", "KUBERNETES_API_KEY_PREFIX",
             "KUBERNETES_CERT_FILE", "KUBERNETES_KEY_FILE", "KUBERNETES_USERNAME",
             "KUBERNETES_PASSWORD", "KUBERNETES_VERIFY_SSL", "KUBERNETES_CA_CERT_FILE")


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


def _in_cluster() -> client.ApiClient:
    configuration = client.Configuration()
    config.load_incluster_config(client_configuration=configuration)
    return client.ApiClient(configuration)


def credential_source(secrets: dict[str, Any] | None = None) -> str:
    """Name where api_client(secrets) takes its credentials from, without loading them:
    "secrets", "environment", "in-pod", "kubeconfig:<path>" or "in-cluster"; raises
    NoCredentialsError when there are none."""
    secrets = dict(secrets or {})
    if any(secrets.get(key) for key in _HOST_KEYS):
        return "secrets"
    if any(os.environ.get(key) for key in _HOST_KEYS):
        return "environment"
    if os.environ.get("CHAOSTOOLKIT_IN_POD") == "true":
        return "in-pod"
    kubeconfig = _kubeconfig_path()
    if os.path.exists(kubeconfig):
        return f"kubeconfig:{kubeconfig}"
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "in-cluster"
    raise NoCredentialsError(
        "no Kubernetes credentials: set KUBERNETES_HOST (+ KUBERNETES_API_KEY ...) in the "
        "experiment's secrets or environment, provide a kubeconfig ($KUBECONFIG or "
        f"~/.kube/config; {kubeconfig} does not exist), or run in a pod")


def api_client(secrets: dict[str, Any] | None = None) -> client.ApiClient:
    """Return a `kubernetes.client.ApiClient` from the first credential source of the module's
    order (secrets, environment, in-pod, kubeconfig, in-cluster)."""
    secrets = dict(secrets or {})
    source = credential_source(secrets)
    logger.debug("Kubernetes API credentials from %s", source)
    if source == "secrets":
        return _from_secrets(secrets)
    if source == "environment":
        return _from_secrets({key: os.environ[key] for key in _ENV_KEYS if key in os.environ})
    if source in ("in-pod", "in-cluster"):
        return _in_cluster()
    configuration = client.Configuration()
    config.load_kube_config(config_file=source.split(":", 1)[1],
                            context=_lookup(secrets, "KUBERNETES_CONTEXT"),
                            client_configuration=configuration, persist_config=False)
    return client.ApiClient(configuration)


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
