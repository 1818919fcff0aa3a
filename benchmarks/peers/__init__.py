"""This project against its peers (torch pipelining, plain training, the published roundpipe package), measured."""
