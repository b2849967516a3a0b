//go:build !unix

package proxy

// openFilesLimit is unknown here: the cap on client connections is the
// default one.
func openFilesLimit() uint64 { return 0 }
