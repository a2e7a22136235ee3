"""What the routes call: submit jobs (`submit`), read and await them (`read`), and look at the
fleet (`fleet`); `wiring` builds them once per process over shared Redis connections."""
