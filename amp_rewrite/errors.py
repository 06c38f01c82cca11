"""One exception hierarchy for every user-facing failure.

The CLI turns each class into one line on stderr and its own exit code (see `exit_code`);
the API raises them as they are. Anything else escaping is a bug in amp-rewrite.
"""


def one_line(text: str) -> str:
    """`text` as one printable line: line breaks in a path or a quoted name are shown escaped, and
    so is anything else unprintable (control characters; bytes a library could not decode, which
    reach Python as lone surrogates)."""
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii") for c in text
    )


class AmpRewriteError(Exception):
    """Base of every error amp-rewrite raises on purpose. `exit_code` is the CLI's status.
    The message is always one line (a newline in a file name is shown as \\n)."""

    exit_code = 1

    def __init__(self, message="", *args):
        super().__init__(one_line(str(message)), *args)


class UsageError(AmpRewriteError):
    """Bad arguments: unknown target, conflicting flags, a bad regex."""

    exit_code = 2


class ModelError(AmpRewriteError):
    """The input is not a usable ONNX model: unreadable, invalid, unsupported, unsafe."""

    exit_code = 3


class OpListError(AmpRewriteError):
    """An op-list YAML file or override is malformed or contradicts itself."""

    exit_code = 4


class OutputError(AmpRewriteError):
    """The result cannot be written: output exists, equals the input, or the disk refused."""

    exit_code = 5


class ValidationError(AmpRewriteError):
    """The rewritten model computes something too far from the original."""

    exit_code = 6


class GradientError(AmpRewriteError):
    """A gradient graph cannot be built: no rule for an op, or a loss that is not scalar."""

    exit_code = 7


class TrainingError(AmpRewriteError):
    """A training configuration or step cannot be carried out."""

    exit_code = 8


class RuntimeUnavailableError(AmpRewriteError):
    """ONNX Runtime is missing or broken: the checks and training cannot run."""

    exit_code = 1
