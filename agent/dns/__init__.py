"""The pod DNS: DNS capture, mesh names, forwarding from the pod netns (issue #42)."""
