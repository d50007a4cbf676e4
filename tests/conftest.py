"""For every test: the shared helpers' asserts (tests/helpers/, imported as ``helpers``) are
rewritten as a test module's are, so a failing check there shows its values. Fixtures shared
by a folder are in that folder's conftest.py; other shared code is in helpers/."""

import pytest

pytest.register_assert_rewrite("helpers")
