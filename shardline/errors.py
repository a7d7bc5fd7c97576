"""One hierarchy of Shardline errors.

Every error says what was wrong, what was got, and what to do. Each subclass also
inherits the builtin exception it resembles, so callers that catch ``ValueError`` or
``LookupError`` keep working. Only the HTTP edge maps these to status codes.

``shown`` is how a message quotes a value a client sent: its repr, cut short (a client
chooses the value, and a 16 MB string or a list nested 1,000 deep must not become a
16 MB message or a RecursionError). ``first_line`` is how a message quotes another library's
error: its first line, so that the message stays one line.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any

_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist, _SHOWN.maxdict = 3, 60, 60, 8, 4


def shown(value: object) -> str:
    """A client's value as a message quotes it: its repr, at most ~80 characters and 3 levels deep."""
    return _SHOWN.repr(value)


def first_line(error: BaseException) -> str:
    """Another library's error as a one-line message quotes it: its first line (its type's name if empty)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def number_out_of_range(error: Exception) -> bool:
    """Whether a JSON parser's error (orjson's) is a number past a double's range (``1e400``): valid JSON, which it
    does not read, so not a body to call invalid JSON."""
    return "number is infinity when parsed as double" in str(error)


class ShardlineError(Exception):
    """Base of every error Shardline raises on purpose.

    ``code``: a short code a wire protocol may carry beside the message (OpenAI's error ``code``); None for most.
    ``param``: the request field at fault, where one is (OpenAI's error ``param``); None for most.
    """

    code: str | None = None
    param: str | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def reworded(self, message: str) -> ShardlineError:
        """The same error (its class and data) with another message: what a caller adds to one it passes on."""
        return _rebuilt(type(self), message, {**self.__dict__, "message": message})

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as its class, message and data: a subclass's ``__init__`` takes more than the message, and a
        Dask worker's error (a model it cannot load) comes back to the flow as the same error, not another."""
        return _rebuilt, (type(self), self.message, dict(self.__dict__))


def _rebuilt(cls: type[ShardlineError], message: str, data: dict[str, Any]) -> ShardlineError:
    """An unpickled Shardline error (``ShardlineError.__reduce__``): its class with its message and data."""
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(data)
    return error


class InvalidSetting(ShardlineError, ValueError):
    """A setting, option or URL is malformed or inconsistent."""


class InvalidInput(ShardlineError, ValueError):
    """Data handed to Shardline does not satisfy what it was checked against."""


class ContextLengthExceeded(InvalidInput):
    """A prompt is longer than the model's context leaves room for (OpenAI's ``context_length_exceeded``)."""

    code = "context_length_exceeded"

    def __init__(self, message: str, prompt_tokens: int, most: int, param: str | None = None) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.most = most
        self.param = param  # the request's prompt field (``messages`` or ``prompt``), where the wire knows it


class SchemaMismatch(InvalidInput):
    """A table's columns or types do not satisfy a model signature."""

    def __init__(self, message: str, problems: list[str]) -> None:
        super().__init__(message)
        self.problems = problems


class NullValues(InvalidInput):
    """A column the model needs holds nulls."""

    def __init__(self, message: str, columns: dict[str, int]) -> None:
        super().__init__(message)
        self.columns = columns


class NonFiniteValues(InvalidInput):
    """A float column the model needs finite numbers in holds NaN or infinity."""

    def __init__(self, message: str, columns: dict[str, int]) -> None:
        super().__init__(message)
        self.columns = columns


class CorruptShard(InvalidInput):
    """A shard cannot be read as Parquet."""


class DataContractFailed(InvalidInput):
    """A sample of a shard fails the model's data contract (expectations from its signature and reference profile)."""

    def __init__(self, message: str, failures: list[str]) -> None:
        super().__init__(message)
        self.failures = failures


class EmptyInput(InvalidInput):
    """An input location holds no shards."""


class InvalidBundle(ShardlineError, ValueError):
    """A model bundle's manifest or layout is wrong."""


class IntegrityError(InvalidBundle):
    """An artifact's bytes do not match the sha256 its manifest records."""

    def __init__(self, message: str, path: str, expected: str, got: str) -> None:
        super().__init__(message)
        self.path = path
        self.expected = expected
        self.got = got


class ModelNotFound(ShardlineError, LookupError):
    """A model name, version or alias is not in the registry."""

    def __init__(self, message: str, reference: str) -> None:
        super().__init__(message)
        self.reference = reference


class ImmutableVersion(ShardlineError, ValueError):
    """A push tried to change the bytes of a version that exists."""


class AliasConflict(ShardlineError, RuntimeError):
    """An alias moved between reading it and moving it (a lost compare-and-swap)."""


class RolloutConflict(AliasConflict):
    """A rollout cannot start or move: another one runs on the model, or none does."""


class GateFailed(ShardlineError, ValueError):
    """A promotion gate refused a version."""

    def __init__(self, message: str, gate: str) -> None:
        super().__init__(message)
        self.gate = gate


class RuntimeUnavailable(ShardlineError, RuntimeError):
    """A runtime, device or extra needed to load a model is not installed here."""


class NotInstalled(RuntimeUnavailable):
    """A package the model's runtime or code needs is not installed where it runs: every worker of a batch job meets
    it, and running again helps only once it is installed (the job ends at the first shard that meets it)."""


class JobFailed(ShardlineError, RuntimeError):
    """A batch job could not finish every shard; a re-run resumes it."""

    def __init__(self, message: str, failed: dict[str, str]) -> None:
        super().__init__(message)
        self.failed = failed


class JobStopped(JobFailed):
    """A batch job was asked to stop (its command interrupted or killed); the parts it committed are kept and
    a re-run resumes."""

    def __init__(self, message: str) -> None:
        super().__init__(message, {})


class Unauthenticated(ShardlineError, PermissionError):
    """A request carries no API key, or one that no tenant holds."""


class RateLimited(ShardlineError, RuntimeError):
    """A tenant is over one of its quotas; retry after ``retry_after`` s. ``quota`` names which, as the
    ``shardline_rate_limited_total{quota}`` metric does: rate, concurrency, streams, tokens or budget."""

    quota = "rate"

    def __init__(self, message: str, tenant: str, retry_after: float, quota: str | None = None) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.retry_after = retry_after
        if quota is not None:
            self.quota = quota


class BudgetExceeded(RateLimited):
    """A tenant is at its monthly budget's hard limit (docs/cost.md, "Budgets"): new work is refused, with the
    figures, until the month ends (``retry_after``: seconds to then, capped) or the budget grows."""

    quota = "budget"


class Overloaded(ShardlineError, RuntimeError):
    """The server sheds this request to keep latency bounded; retry after ``retry_after`` s."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ReplicasUnavailable(Overloaded):
    """The router has no replica that could take the request now (all down, their breakers open, or
    every try failed within the retry budget); retry after ``retry_after`` s."""


class DeadlineExceeded(ShardlineError, TimeoutError):
    """The request's deadline (``X-Shardline-Timeout-Ms``, or the router's default) passed before an answer."""


class InvalidParameter(InvalidInput):
    """A request parameter (``max_tokens``, ``temperature``, ``messages``, ...) is out of range or malformed;
    ``param`` names it, as OpenAI's error object does."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class PayloadTooLarge(InvalidInput):
    """A request body is over the server's size limit (before or after decompression)."""

    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


class UnsupportedEncoding(InvalidInput):
    """A request body is compressed with an encoding the server does not read."""


class InferenceFailed(ShardlineError, RuntimeError):
    """A model failed on rows that had passed its signature check (a fault of the model or server)."""


class NotServed(ShardlineError, NotImplementedError):
    """An endpoint that this server does not offer yet."""


class AccessDenied(ShardlineError, PermissionError):
    """A batch job names a location outside its tenant's storage prefixes, or a tenant the file does not list."""

    def __init__(self, message: str, tenant: str) -> None:
        super().__init__(message)
        self.tenant = tenant


class QuotaExceeded(ShardlineError, RuntimeError):
    """A tenant's batch quota (GPU-hours per day) is used up; the job was not started."""

    def __init__(self, message: str, tenant: str, used: float, limit: float) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.used = used
        self.limit = limit


class ProtectedAlias(AliasConflict):
    """A protected alias is set already (or a racing first set won): it moves only through promotion or rollback."""

    def __init__(self, message: str, reference: str) -> None:
        super().__init__(message)
        self.reference = reference


class RegistryUnreadable(ShardlineError, OSError):
    """The registry's storage refused to read a record; the message names the model, the log its location."""


class OutputInUse(ShardlineError, RuntimeError):
    """A batch output folder is owned by another running job, or holds another model's parts; nothing was written.

    ``holder`` is the job id of the running job or of the one whose parts are there (None when unknown).
    """

    def __init__(self, message: str, output: str, holder: str | None) -> None:
        super().__init__(message)
        self.output = output
        self.holder = holder


class OutputNotWritable(ShardlineError, PermissionError):
    """A batch output cannot be written (it is a file, read-only or not permitted): re-running will not help."""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(message)
        self.output = output


class PrefectServerUnavailable(ShardlineError, RuntimeError):
    """The local Prefect server batch runs share could not be started; the message names its log."""


class ChildNotReady(ShardlineError, RuntimeError):
    """A process Shardline started exited, or was not ready in time (``shardline.processes``); the message names it
    and quotes its log's last lines. ``returncode``: how it exited (None: it was not ready in time, and stopped)."""

    def __init__(self, message: str, returncode: int | None, log_path: Path | None) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.log_path = log_path


def yaml_problem(error: Exception) -> str:
    """A YAML parser's error (PyYAML's or ruamel's) in one line: what is wrong and where (``expected ',' or ']', but
    got '<stream end>' at line 1, column 9``). Their own text spans several lines, with the source and a caret."""
    problem = getattr(error, "problem", None)
    mark = getattr(error, "problem_mark", None)
    if not problem:
        return " ".join(str(error).split())
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"
