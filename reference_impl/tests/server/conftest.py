"""tests/server/ mirrors hybridkv/server/ where a test covers one layer (front/, ops/, books/, l2/, machinery/); the
rest start a real server and cross every layer. Helpers shared with the subfolders stay here (rediskit,
turns_serve): pytest puts a conftest's folder on sys.path, as reference_impl/tests/conftest.py does for serverkit."""
