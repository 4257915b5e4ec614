"""`fsdpjob report`: the report and its text (run.py), the picture as data (picture.py), its drawing (plot.py) and
the HTML page (html.py). A run's goodput from its record is views/goodput.py, which the status view reads too."""
