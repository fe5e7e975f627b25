"""The test suite, in folders by kind (tests/conftest.py gives the integration marker by folder); the
modules here are helpers that several folders share."""
