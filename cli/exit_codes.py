"""Exit codes shared by both CLIs and their tests. No bare numbers elsewhere."""
OK = 0
REGRESSION = 1
BAD_INPUT = 2
