"""The test suite: folders by behaviour (each a directory of test modules with unique names), helpers in ``support``."""
