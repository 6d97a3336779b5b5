"""Tests of the client, deploying and the command line (``raymq``)."""
