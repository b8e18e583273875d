"""The one error type the CLI turns into a one-line message and exit code 2."""


class QuantshipError(Exception):
    """A problem with the user's input, explained in one line.

    ``path`` names the file or directory at fault so the message always says where to look.
    """

    def __init__(self, message: str, path: object | None = None):
        self.path = None if path is None else str(path)
        super().__init__(f"{self.path}: {message}" if self.path else message)
