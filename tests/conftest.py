"""Test-wide settings, applied before any test module imports torch."""
import os

# The trusted re-check's observer uses torch's profiler, whose library prints a banner on
# every start and stop unless this is set before torch is imported.
os.environ.setdefault("KINETO_LOG_LEVEL", "5")
