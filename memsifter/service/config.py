"""The service's configuration: one pydantic model, like every stage config (unknown keys are errors).

No secret is ever a value here: API keys and an endpoint's key are named by the environment variables
that hold them (in a cluster, set from a Kubernetes Secret). The same model is what ``memsifter serve``
builds from its flags and what a RayService's ``serveConfigV2`` passes as the application's ``args``
(:func:`memsifter.service.app.build_app`).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import ConfigError
from ..retrieval.ranker import RankerOptions
from .extract import ExtractSettings

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Corpus and user ids: what a URL path segment and a storage key can hold safely.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@+=-]{0,199}$"
ID_RE = re.compile(ID_PATTERN)
METHODS = ("auto", "zsum", "cascade", "bm25", "bm25_dated", "bm25_window")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Grant(_Model):
    """What one API key (or an anonymous request) may do: ``fnmatch`` patterns of ids (``*`` = any)."""

    read: list[str] = Field(default_factory=list, description="corpus / user ids it may retrieve from and search")
    write: list[str] = Field(default_factory=list, description="user ids whose memories it may append to and delete")

    def single_read(self) -> str | None:
        """The one corpus this grant reads when it names exactly one literal id (no pattern)."""
        lit = [p for p in self.read if not any(c in p for c in "*?[")]
        return lit[0] if len(self.read) == 1 and lit else None


class AuthConfig(_Model):
    """API keys by reference: ``keys`` maps the NAME of an environment variable to what the key it holds
    may read and write. A request sends its key as ``Authorization: Bearer <key>`` or ``X-API-Key``."""

    keys: dict[str, Grant] = Field(default_factory=dict, description="env var name -> grant")
    keys_file: str | None = Field(None, description="a JSON/YAML file (local or s3://) with more of the same "
                                  "mapping (env var name -> grant), e.g. a mounted ConfigMap")
    anonymous: Grant | None = Field(None, description="what a request without a key may do (null: nothing, "
                                    "401); on a host other than loopback only with allow_anonymous_remote")
    allow_anonymous_remote: bool = Field(False, description="accept `anonymous` on a non-loopback host (a "
                                         "trusted network, e.g. in-cluster Search-R1 training whose client "
                                         "cannot send a header)")

    @field_validator("keys")
    @classmethod
    def _names(cls, v: dict[str, Grant]) -> dict[str, Grant]:
        for name in v:
            if not ENV_NAME.match(name):
                raise ValueError(f"auth.keys: {name[:40]!r} is not an environment variable name (the key itself "
                                 "never goes in the config: name the variable that holds it)")
        return v


class Limits(_Model):
    """Bounds on what one request may ask (a request over one gets a 4xx naming the bound)."""

    max_queries: int = Field(64, ge=1, le=10_000, description="queries per /retrieve request")
    max_query_chars: int = Field(4096, ge=1, le=1 << 20, description="characters per query")
    max_topk: int = Field(100, ge=1, le=10_000, description="largest topk / top_k")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="request body of /retrieve and /search")
    max_memory_body_bytes: int = Field(32 << 20, ge=1024, description="request body of POST /memories")
    max_sessions_per_append: int = Field(1000, ge=1, description="sessions per POST /memories")
    max_turns_per_session: int = Field(5000, ge=1)
    max_turn_chars: int = Field(1 << 20, ge=1, description="characters per turn's content")
    max_user_sessions: int = Field(100_000, ge=1, description="sessions in one user's memory")
    ranker_timeout_s: float = Field(120.0, gt=0, description="a ranked request falls back to the first stage "
                                    "after this long")


class RankerSettings(RankerOptions):
    """The ranker deployment: the ranker's options as the rank stage takes them (:class:`memsifter.retrieval.
    ranker.RankerOptions`: the same fields, session window and defaults, so a ranker is served as it is
    trained and batch-ranked), served by vLLM in-process (``engine: vllm``, a GPU deployment) or by an
    OpenAI-compatible endpoint; plus the deployment's own settings."""

    temperature: float = Field(0.0, ge=0, description="sampling temperature (0: the same answer for the same "
                               "query; the rank stage's default is 0.6)")
    candidates: int = Field(50, ge=1, description="first-stage sessions sent to the ranker (most similar first)")
    max_batch_size: int = Field(16, ge=1, description="@serve.batch: requests per engine call")
    batch_wait_timeout_s: float = Field(0.01, ge=0)
    vllm_kwargs: dict = Field(default_factory=dict, description="engine vllm: extra vllm.LLM arguments")
    num_gpus: float = Field(1.0, ge=0, description="GPUs per ranker replica (0 on a CPU-only cluster)")
    num_cpus: float = Field(1.0, gt=0)
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)


# A query encoder's forward pass's fixed cost in tokens (memsifter.service.index.length_groups)
QUERY_PASS_TOKENS = 40


class ServeConfig(_Model):
    """``memsifter serve``: the online first stage (and ranker) over an embed stage's publication."""

    index: str = Field(description="embed stage output (local dir or s3://): its _SUCCESS, config and store")
    dataset: str | None = Field(None, description="the dataset the embed stage read (default: its config's input)")
    state: str | None = Field(None, description="where user memories and vectors the service computed are kept "
                              "(local dir or s3://); null: no memory API, vectors in memory only")
    method: Literal[METHODS] = Field("auto", description="first-stage method (auto: the embed stage's primary; "
                                     "zsum, cascade and the BM25 views are served)")
    reuse_query_vectors: bool = Field(True, description="a query whose exact text the embed stage embedded gets "
                                      "its stored vector (the one its rankings used) instead of a new forward pass")
    precompute_units: bool = Field(True, description="embed every session's units at load (in the background: "
                                   "a query meanwhile embeds the few it needs)")
    default_topk: int = Field(3, ge=1, description="topk of /retrieve when the request gives none (Search-R1: 3)")
    default_corpus: str | None = Field(None, description="corpus of a /retrieve naming none (else: the key's only "
                                       "corpus, else 400)")
    reload_poll_s: float = Field(30.0, ge=0, description="seconds between checks of the index's _SUCCESS "
                                 "(0: never reload)")
    memory_refresh_s: float = Field(2.0, ge=0, description="a replica re-reads a user's memory from the store at "
                                    "most this often (appends made by other replicas)")
    memory_compact_files: int = Field(256, ge=0, description="a mem0 owner's log is folded into a snapshot once "
                                      "more event files than this follow its last one, so that a re-read lists "
                                      "and reads O(this), not every event ever (0: never fold)")
    memory_compact_at_start: bool = Field(True, description="fold every mem0 owner's log that has more than "
                                          "memory_compact_files event files before the replica is ready (readiness "
                                          "waits), instead of on each owner's first read while serving")
    memory_compact_grace_s: float = Field(60.0, ge=0, description="what a snapshot folded (event files, older "
                                          "snapshots) is removed this long after a replica first saw it: longer "
                                          "than any listing of the state takes (mem0.py: Snapshots)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    torch_threads: int | None = Field(None, ge=1, description="threads of the query encoder (default: the cores "
                                      "but one, 1 to 2: memsifter.service.index.encoder_threads)")
    query_encoder_process: bool | None = Field(False, description="queries embedded in a process of its own (the "
                                               "same model and vectors, no GIL shared with the event loop; another "
                                               "copy of the model in memory; a script that runs the service needs "
                                               "the `if __name__ == '__main__'` guard: the process is spawned); "
                                               "null: where no GPU is seen")
    query_batch: int = Field(32, ge=1, description="queries embedded in one forward pass at most")
    query_batch_wait_s: float = Field(0.002, ge=0, description="how long a query waits for others to batch with")
    query_pass_tokens: int = Field(QUERY_PASS_TOKENS, ge=0, description="a forward pass's fixed cost in tokens, for splitting a "
                                   "batch of queries into length groups (memsifter.service.index.length_groups; "
                                   "40 suits all-MiniLM-L6-v2 on a CPU; a large value: one batch padded to its "
                                   "longest query)")
    auth: AuthConfig = Field(default_factory=AuthConfig)
    limits: Limits = Field(default_factory=Limits)
    ranker: RankerSettings | None = Field(None, description="the ranker (mode ranked); null: ranked falls back")
    # mem0-compatible adds with fact extraction (issue 46; memsifter.service.extract)
    extract: ExtractSettings | None = Field(None, description="mem0 adds (infer): the facts in the messages, "
                                            "through this OpenAI-compatible endpoint; null: each message stored "
                                            "as sent and nothing is sent anywhere")
    num_cpus: float = Field(1.0, gt=0, description="CPUs of a first-stage replica")
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1, description="first-stage replicas at most (each holds the whole index; "
                              "several need an s3:// state)")
    target_ongoing_requests: float = Field(16, gt=0, description="Serve autoscaling target per replica")

    @field_validator("default_corpus")
    @classmethod
    def _corpus(cls, v: str | None) -> str | None:
        if v is not None and not ID_RE.match(v):
            raise ValueError(f"default_corpus {v[:40]!r} is not a valid id")
        return v

    @model_validator(mode="after")
    def _checks(self) -> "ServeConfig":
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas < min_replicas")
        a = self.auth.anonymous
        if a and (a.read or a.write) and not is_loopback(self.host) and not self.auth.allow_anonymous_remote:
            raise ValueError(f"auth.anonymous grants access on host {self.host}, which is not loopback: give keys "
                             "(auth.keys) or set auth.allow_anonymous_remote: true")
        return self


def is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_config(data: dict, source: str = "serve config") -> ServeConfig:
    """A :class:`ServeConfig` from a mapping, or one :class:`ConfigError` line naming the field."""
    from pydantic import ValidationError

    try:
        return ServeConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ())) or "(top level)"
        raise ConfigError(f"{source}: {loc}: {err.get('msg')}") from None
