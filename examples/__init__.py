"""What runs from a checkout and is not in the wheel: ``make demo``'s part without a cluster
(``demo``) and the small file server it pulls from (``devserver``)."""
