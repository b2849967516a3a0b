package main

import "syscall"

// procAttr makes a child die with kvoverhead, so a crashed run leaves no
// engine or proxy behind.
func procAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
