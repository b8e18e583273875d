"""The one error type the CLI turns into a one-line message and exit code 2, and how a stop by signal is told
apart from an error."""

import signal


class QuantshipError(Exception):
    """A problem with the user's input, explained in one line.

    ``path`` names the file or directory at fault so the message always says where to look.
    """

    def __init__(self, message: str, path: object | None = None):
        self.path = None if path is None else str(path)
        super().__init__(f"{self.path}: {message}" if self.path else message)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so the same cleanup runs."""


# The signal that asked this process to stop, set by the CLI's handlers. A handler's exception raised while
# native code runs (torch building a tensor for safetensors, say) can come out as that code's own error
# instead, which would then pass for bad input: this record says what really happened.
_received = {"signal": None}


def stop_signal() -> int | None:
    """The signal (SIGINT or SIGTERM) that asked this process to stop, or None."""
    return _received["signal"]


def clear_stop() -> None:
    _received["signal"] = None


def stop_on_signal(signum, frame):
    """Signal handler for SIGINT and SIGTERM: records the stop, then unwinds like Ctrl-C."""
    if signum == signal.SIGTERM:  # a second SIGTERM must not cut the cleanup short (a second Ctrl-C may)
        signal.signal(signum, signal.SIG_IGN)
    _received["signal"] = signum
    raise _stop_exception(signum)


def _stop_exception(signum: int) -> KeyboardInterrupt:
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def as_stop(exc: BaseException) -> BaseException:
    """The exception to unwind with: ``exc``, or the stop it stands for when a signal arrived meanwhile."""
    signum = stop_signal()
    if signum is None or isinstance(exc, KeyboardInterrupt):
        return exc
    return _stop_exception(signum)


def raise_if_stopped() -> None:
    """A safe point of long work: stops it if a signal arrived whose exception native code swallowed."""
    signum = stop_signal()
    if signum is not None:
        raise _stop_exception(signum)
