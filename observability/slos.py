"""SLOs as configuration: classes of models, each with objectives over an SLI the platform exports.

A class names the models it holds (regular expressions, matched whole, as PromQL's ``=~`` matches) and
its objectives: an SLI from ``SLIS`` and a target (the share of good events, e.g. 0.999), with a
threshold for the latency SLIs (seconds; it must be one of the histogram's bucket bounds, or the
ratio could not be read off the buckets). A model belongs to the first class of its tier that names
it: later classes exclude what earlier ones hold, so a model is counted once (a catch-all ``.+``
last is the usual default). ``deploy/observability/slos.yaml`` is the shipped file; ``load_slos``
reads one and checks all of it, ``render`` (``shardline.observability``) turns it into rules and
dashboards.

Each SLI says what counts as good and bad, over which series:

- ``availability``: answers of the replicas (``shardline_requests_total``): 5xx are bad; 4xx are the
  caller's and count as answered (a 429 over a tenant's quota is the quota doing its work);
- ``latency``: the replicas' time from request to response (``shardline_request_seconds``): an
  answer within ``threshold_seconds`` is good;
- ``ttft``: a generation's time to its first token (``shardline_llm_time_to_first_token_seconds``);
- ``tpot``: the time between two tokens of a stream (``shardline_llm_inter_token_seconds``): every
  gap over the threshold is bad, which is stricter than a per-request mean time per output token;
  it has no tenant label, so it has no per-tenant alert;
- ``deadline``: batch runs decided by their deadline (``shardline_batch_job_deadlines_total``,
  ``tasks/batch_telemetry.py``): ``missed`` (ended after it) is bad, ``met`` (completed by it) good;
  a run that fails before its deadline is not counted (its rerun is).

Pure: no I/O but reading the file in ``load_slos``.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shardline.errors import InvalidSetting
from shardline.tenants import read_yaml, validation_problems

Tier = Literal["online", "batch"]


@dataclass(frozen=True)
class Sli:
    """What one kind of SLI counts: the series, what makes an event bad, and its alerts' names."""

    name: str
    title: str  # as an alert's summary says it
    metric: str  # a counter (with ``_total``) or a histogram's base name
    histogram: bool  # bad = over the threshold (a bucket bound); else ``bad`` selects the bad events
    bad: str | None  # a label matcher selecting bad events of a counter
    tenant: bool  # the series carry a ``tenant`` label: per-tenant rules and alerts
    tier: Tier
    alert: str  # the per-model alert; the per-tenant one is ``tenant_alert``

    @property
    def tenant_alert(self) -> str | None:
        """The per-tenant alert's name (None when the series have no tenant label)."""
        return self.alert.replace("Shardline", "ShardlineTenant", 1) if self.tenant else None


SLIS: dict[str, Sli] = {s.name: s for s in (
    Sli("availability", "availability", "shardline_requests_total", False, 'code=~"5.."', True, "online",
        "ShardlineAvailabilityBudgetBurn"),
    Sli("latency", "latency", "shardline_request_seconds", True, None, True, "online", "ShardlineLatencyBudgetBurn"),
    Sli("ttft", "time to first token", "shardline_llm_time_to_first_token_seconds", True, None, True, "online",
        "ShardlineTTFTBudgetBurn"),
    Sli("tpot", "time per output token", "shardline_llm_inter_token_seconds", True, None, False, "online",
        "ShardlineTPOTBudgetBurn"),
    Sli("deadline", "deadline", "shardline_batch_job_deadlines_total", False, 'outcome="missed"',
        True, "batch", "ShardlineBatchDeadlineBudgetBurn"),
)}
_NAME = re.compile(r"[a-z][a-z0-9-]{0,62}")


class Objective(BaseModel):
    """One objective of a class: an SLI, its target and (latency SLIs) its threshold."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sli: str = Field(description="The SLI: " + ", ".join(SLIS) + ".")
    target: float = Field(gt=0.5, lt=1.0, description="The share of good events, e.g. 0.999.")
    threshold_seconds: float | None = Field(default=None, gt=0, description="The latency SLIs' bound, in seconds.")

    @field_validator("sli")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in SLIS:
            raise ValueError(f"is not an SLI; use one of {', '.join(SLIS)}")
        return value

    @model_validator(mode="after")
    def _threshold(self) -> "Objective":
        histogram = SLIS[self.sli].histogram
        if histogram and self.threshold_seconds is None:
            raise ValueError(f"the {self.sli} SLI needs threshold_seconds (a bucket bound of its histogram)")
        if not histogram and self.threshold_seconds is not None:
            raise ValueError(f"the {self.sli} SLI takes no threshold_seconds")
        return self


class SloClass(BaseModel):
    """A class of models with its objectives."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="A short name: lowercase letters, digits and dashes.")
    description: str = Field(default="", description="What the class is for (shown on the dashboards).")
    models: tuple[str, ...] = Field(min_length=1, description="Regular expressions matched whole against the "
                                    "model label (RE2 syntax, as PromQL's =~).")
    objectives: tuple[Objective, ...] = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.fullmatch(value):
            raise ValueError("must be lowercase letters, digits and dashes, starting with a letter")
        return value

    @field_validator("models")
    @classmethod
    def _patterns(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in value:
            _check_re2(pattern)
        return value

    @model_validator(mode="after")
    def _one_tier(self) -> "SloClass":
        tiers = {SLIS[o.sli].tier for o in self.objectives}
        if len(tiers) > 1:
            raise ValueError("mixes online and batch SLIs; make a class for each tier")
        twice = _repeated([o.sli for o in self.objectives])
        if twice:
            raise ValueError(f"has more than one objective on {', '.join(twice)}; keep one per SLI")
        return self

    @property
    def tier(self) -> Tier:
        """Online or batch: what its SLIs measure."""
        return SLIS[self.objectives[0].sli].tier


def _repeated(values: list[str]) -> list[str]:
    """The values that occur more than once, sorted."""
    return sorted({v for v in values if values.count(v) > 1})


class SloConfig(BaseModel):
    """The whole file: the runbooks' address, the scrape jobs watched, the classes in order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    runbook_url: str = Field(description="The runbooks' page; each alert's runbook_url is it plus '#<alert>'.")
    scrape_jobs: str = Field(default="shardline.*", min_length=1, description="Regular expression (RE2 syntax, "
                             "matched whole) of the Prometheus jobs that scrape Shardline; a target of theirs that is "
                             "down raises ShardlineScrapeTargetDown.")
    classes: tuple[SloClass, ...] = Field(min_length=1)

    @field_validator("scrape_jobs")
    @classmethod
    def _scrape_jobs(cls, value: str) -> str:
        _check_re2(value)
        return value

    @model_validator(mode="after")
    def _unique(self) -> "SloConfig":
        twice = _repeated([c.name for c in self.classes])
        if twice:
            raise ValueError(f"class names must differ; {', '.join(twice)} is used more than once")
        return self

    @cached_property
    def slos(self) -> tuple["Slo", ...]:
        """Every objective of every class, with the selector of the models it counts."""
        slos = []
        for index, cls in enumerate(self.classes):
            earlier = [p for c in self.classes[:index] if c.tier == cls.tier for p in c.models]
            for objective in cls.objectives:
                slos.append(Slo(cls, objective, tuple(earlier)))
        return tuple(slos)


@dataclass(frozen=True)
class Slo:
    """One objective of one class, as the rules count it."""

    cls: SloClass
    objective: Objective
    excluded: tuple[str, ...]  # the patterns of the earlier classes of its tier

    @property
    def sli(self) -> Sli:
        """What the SLI counts."""
        return SLIS[self.objective.sli]

    @property
    def id(self) -> str:
        """The ``slo`` label: class and SLI (``llm-interactive-ttft``)."""
        return f"{self.cls.name}-{self.objective.sli}"

    @property
    def budget(self) -> float:
        """The share of bad events allowed (1 - target)."""
        return round(1.0 - self.objective.target, 12)

    def selector(self) -> str:
        """The label matchers of the models it counts: its class's patterns, less the earlier classes'."""
        matchers = [f'model=~"{promql_string("|".join(self.cls.models))}"']
        if self.excluded:
            matchers.append(f'model!~"{promql_string("|".join(self.excluded))}"')
        return ", ".join(matchers)


def promql_string(text: str) -> str:
    """``text`` inside a PromQL double-quoted string (Go's escapes: backslash, quote, control characters)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


# What RE2 (PromQL's regular expressions) lacks, though Python's ``re`` reads it: (construct, what it is).
_RE2_LACKS = (("(?=", "a lookahead"), ("(?!", "a lookahead"), ("(?<=", "a lookbehind"), ("(?<!", "a lookbehind"),
              ("(?>", "an atomic group"), ("(?P=", "a named backreference"), ("(?(", "a conditional group"),
              ("(?#", "a comment group"))
_RE2_FLAGS = frozenset("ims")  # the inline flags both read alike (RE2 also has U, Python also a, L, u, x)
_REPEAT = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")
RE2_MAX_REPEAT = 1000


def _check_re2(pattern: str) -> None:
    """``pattern`` is a regular expression RE2 reads as Python does (PromQL's ``=~``), else ValueError saying
    what it uses that RE2 has not: a backreference, a possessive quantifier, an atomic group, a lookaround, a
    conditional, an inline flag other than i, m and s, ``\\Z``, ``{,n}`` or a repetition over 1000."""
    try:
        with warnings.catch_warnings():  # "possible nested set": [[:alpha:]], a POSIX class to RE2
            warnings.simplefilter("ignore", FutureWarning)
            re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{pattern!r} is not a regular expression ({e})") from e
    problem = _re2_problem(pattern)
    if problem:
        raise ValueError(f"{pattern!r} uses {problem}, which PromQL's RE2 does not have")


def _re2_problem(pattern: str) -> str | None:
    """The first construct of ``pattern`` (one Python's ``re`` compiles) that RE2 lacks, or None."""
    i, quantified = 0, False  # quantified: the item before was a quantifier (a ``+`` after it is possessive)
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            escaped = pattern[i + 1:i + 2]
            if escaped in "123456789" and escaped and not re.match(r"[0-7]{3}", pattern[i + 1:i + 4]):  # not octal
                return f"a backreference (\\{escaped})"
            if escaped in ("Z", "u", "U", "N"):
                return {"Z": "\\Z (write $)"}.get(escaped, f"the escape \\{escaped} (write the character itself)")
            i, quantified = i + 2, False
        elif c == "[":
            i, quantified = _class_end(pattern, i), False
        elif c == "(":
            problem = next((what for start, what in _RE2_LACKS if pattern.startswith(start, i)), None)
            if problem:
                return problem
            flags = re.match(r"\(\?([a-zA-Z]*)(?:-([a-zA-Z]*))?[:)]", pattern[i:])
            wrong = set("".join(flags.groups(""))) - _RE2_FLAGS if flags else set()
            if wrong:
                return f"the inline flag {''.join(sorted(wrong))}"
            i, quantified = i + 1, False
        elif c in "*+?":
            if quantified and c == "+":
                return f"a possessive quantifier ({pattern[i - 1]}+)"
            i, quantified = i + 1, not (quantified and c == "?")  # ``*?``: lazy, and the quantifier ends there
        elif c == "{" and (repeat := _REPEAT.match(pattern, i)) and repeat.group() != "{}":  # ``{}``: text in both
            low, comma, high = repeat.groups()
            if not low:
                return f"{repeat.group()} (RE2 reads it as text; write {{0{comma or ''}{high}}})"
            if max(int(low), int(high or 0)) > RE2_MAX_REPEAT:
                return f"a repetition over {RE2_MAX_REPEAT} ({repeat.group()})"
            i, quantified = repeat.end(), True
        else:
            i, quantified = i + 1, False
    return None


def _class_end(pattern: str, start: int) -> int:
    """The index after the character class that opens at ``start`` (``]`` first in it is a member)."""
    i = start + 1
    if pattern.startswith("^", i):
        i += 1
    if pattern.startswith("]", i):
        i += 1
    while i < len(pattern):
        if pattern[i] == "\\":
            i += 2
        elif pattern.startswith("[:", i) and (end := pattern.find(":]", i + 2)) != -1:
            i = end + 2  # a POSIX class, [:alpha:]
        elif pattern[i] == "]":
            return i + 1
        else:
            i += 1
    return i


def parse_slos(data: Any, where: str) -> SloConfig:
    """Check parsed YAML against the SLO format.

    Raises:
        InvalidSetting: naming every wrong field (``classes[1].objectives[0].target``) and what it got.
    """
    try:
        return SloConfig.model_validate(data)
    except ValidationError as e:
        raise InvalidSetting(f"the SLO file {where} is not valid: {validation_problems(e)}; see docs/slo.md for "
                             "the format") from e


def load_slos(path: str | Path) -> SloConfig:
    """Read an SLO file (YAML) and check all of it.

    Raises:
        InvalidSetting: the file is missing, is not YAML, or a field is wrong.
    """
    data = read_yaml(path, "the SLO file", "pass the file with --config (the shipped one is "
                     "deploy/observability/slos.yaml)")
    return parse_slos(data, str(path))


def check_thresholds(config: SloConfig, bounds: Mapping[str, Sequence[float]]) -> None:
    """Every latency threshold is a bucket bound of its histogram (``bounds``: histogram -> its buckets, as the
    code exports them; a histogram not given is not checked).

    Raises:
        InvalidSetting: naming the class, the SLI, the threshold and the bounds it may take.
    """
    for slo in config.slos:
        threshold = slo.objective.threshold_seconds
        known = bounds.get(slo.sli.metric)
        if threshold is None or known is None or any(abs(threshold - b) < 1e-12 for b in known):
            continue
        raise InvalidSetting(
            f"class {slo.cls.name!r}: the {slo.sli.name} threshold {threshold:g} s is not a bucket bound of "
            f"{slo.sli.metric}, so its share could not be read off the buckets; use one of "
            f"{', '.join(f'{b:g}' for b in known)}")
