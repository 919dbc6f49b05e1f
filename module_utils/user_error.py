"""The one root of the errors the user caused: reported as a message, not a traceback (the CLI exits 2).

Subclasses have no second base such as ValueError, so an `except ValueError` stays what it reads as; a second base
only where code we do not own decides by it, with a test in tests/unit/module_utils/test_user_error.py."""


class UserError(Exception):
    """An error the user caused and can fix; its message says what to fix."""
