"""One exception type for everything a user can get wrong; the CLI prints it as one line."""


class VitconvertError(Exception):
    """A problem with the user's input (names, paths, files, options), explained in one sentence."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first non-empty line of an exception's message (cut at ``limit``), or its type name when empty."""
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()[:limit]
    return type(e).__name__


class BadValue(VitconvertError):
    """A bad value of one named parameter (``img_size``): the library speaks of the value, the CLI names the flag
    that gave it (``--img-size``), so library errors never assume the command line."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name
