"""The episode viewer (``computerrl episodes``): a run's recorded episodes (``collect.py``) as static pages
(``pages.py``) or as text for a terminal (``text.py``)."""
