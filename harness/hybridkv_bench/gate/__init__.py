"""`hybridkv gate`: a baseline file (`baseline`), the checks a run must pass (`checks`), and writing a baseline
from a run (`write`)."""
